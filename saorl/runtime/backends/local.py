"""Where rollout workers run: the local backend, worker processes on this machine (the seam,
:class:`~saorl.runtime.backends.base.Backend`, and its message folding are in ``base.py``).

A backend takes :class:`~saorl.runtime.backends.messages.RolloutRequest` s, returns finished trajectories
as they arrive, and keeps its workers alive: a worker that dies is restarted and the rollout ids
it held are reported as lost, so the feed re-queues them (nothing in flight is skipped). A worker
that is alive but makes no progress — stopped (``SIGSTOP``), deadlocked, stuck in a call that never
returns — is killed and restarted the same way once it has made none for its limit, which starts
at ``stall_s`` (``runtime.worker_stall_s``, 60 s) and grows with its slowest measured stretch and
the machine's load; progress is its tokens decoded, calls made and CPU used, read without a
message, so a slow worker is never taken for a stalled one
(:mod:`saorl.runtime.backends.watchdog`). Past ``max_restarts`` restarts it raises
:class:`WorkerFailure`.

Implementations: :class:`LocalBackend` (one spawned OS process per worker, typed messages over
``multiprocessing`` queues; a worker dies with the trainer, see :mod:`saorl.runtime.backends.lifeline`),
:class:`~saorl.runtime.backends.inprocess.InProcessBackend` (episodes on one engine in this process:
tests, evaluation, value pretraining) and :class:`~saorl.runtime.backends.ray_actors.RayBackend` (one
Ray actor per worker, on a cluster).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time

from saorl.runtime.backends.base import Backend, WorkerFailure, collect, drain
from saorl.runtime.backends.lifeline import run_worker
from saorl.runtime.backends.messages import (
    PollResult,
    RolloutRequest,
)
from saorl.runtime.backends.watchdog import StallWatch, WorkerPulse, process_cpu_s
from saorl.runtime.backends.worker import WorkerSpec


@contextlib.contextmanager
def _main_script_hidden():
    """Start a spawned worker without it running the user's ``__main__`` script again.

    ``multiprocessing``'s spawn re-imports the parent's main script in every child, so a script
    that calls :func:`saorl.training.train` at its top level, without an ``if __name__ ==
    "__main__":`` guard, would start the training again in each worker, which fails at once and
    is restarted until the run gives up. A worker needs nothing from that script (its env, reward
    functions and models come by name from the worker spec), so while the process starts, the
    main module's file and spec are hidden from spawn's preparation, which then imports nothing.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


class LocalBackend:
    """Rollout workers as spawned processes on this machine."""

    def __init__(self, spec: WorkerSpec, num_workers: int, concurrency: int, max_restarts: int = 5,
                 stall_s: float = 60.0) -> None:
        self.spec, self.num_workers, self.concurrency = spec, num_workers, concurrency
        self.max_restarts, self.stall_s = max_restarts, stall_s
        self._seen: list[float | None] = [None] * num_workers
        """When each worker's last message was read (None: it has not sent its first yet)."""
        self._ctx = mp.get_context("spawn")
        self._pulses: list[WorkerPulse | None] = [None] * num_workers
        self.watch = StallWatch(num_workers, stall_s)
        """Each worker's progress and stall limit (:mod:`saorl.runtime.backends.watchdog`)."""
        self._results = self._ctx.Queue()
        self._procs: list = [None] * num_workers
        self._queues: list = [None] * num_workers
        self._assigned: list[set[int]] = [set() for _ in range(num_workers)]
        self._stats: dict[int, dict] = {}
        self.restarts = 0

    # ---------------------------------------------------------------- workers
    def _spawn(self, i: int) -> None:
        q = self._ctx.Queue()
        pulse = WorkerPulse(self._ctx)
        # the worker dies with this process (saorl.runtime.backends.lifeline); Linux's parent-death signal
        # follows the thread that starts the worker, so only the main thread asks for it
        main = threading.current_thread() is threading.main_thread()
        args = (os.getpid(), main, i, pickle.dumps(self.spec), q, self._results, pulse)
        p = self._ctx.Process(target=run_worker, args=args, name=f"saorl-rollout-{i}", daemon=True)
        with _main_script_hidden():
            p.start()
        self._procs[i], self._queues[i], self._seen[i], self._pulses[i] = p, q, None, pulse
        self.watch.forget(i)

    def start(self) -> None:
        for i in range(self.num_workers):
            self._spawn(i)

    def ready(self) -> bool:
        return len(self._stats) >= self.num_workers

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _check_alive(self, out: PollResult) -> None:
        for i, p in enumerate(self._procs):
            if p is None:
                continue
            if not p.is_alive():
                self._restart(i, out, f"died (exit code {p.exitcode})")
                continue
            if self._seen[i] is None:  # its engine is not built yet: not judged
                continue
            self.watch.watch(i)
            idle = self.watch.stalled(i, self._pulses[i].read(), process_cpu_s(p.pid))
            if idle is not None:  # no token, no call, no CPU for its limit: stopped, deadlocked, stuck
                p.kill()
                p.join(5.0)
                self._restart(i, out, self.watch.why(i, idle))

    def _restart(self, i: int, out: PollResult, what: str) -> None:
        if self.restarts >= self.max_restarts:  # restarts counts those done, not this death
            raise WorkerFailure(f"rollout worker {i} {what}; the workers were restarted {self.restarts} "
                                f"times already (at most {self.max_restarts} per run), giving up; see the "
                                "log above for why, then continue with saorl train --resume RUN_DIR")
        self.restarts += 1
        n = len(self._assigned[i])
        out.errors.append(f"rollout worker {i} {what}; restarted, {n} rollouts re-queued")
        out.lost.extend(sorted(self._assigned[i]))
        self._assigned[i].clear()
        self._spawn(i)

    # --------------------------------------------------------------- requests
    def free_slots(self) -> int:
        return sum(self.concurrency - len(a) for a in self._assigned)

    def submit(self, req: RolloutRequest) -> None:
        i = min(range(self.num_workers), key=lambda j: len(self._assigned[j]))
        if len(self._assigned[i]) >= self.concurrency:
            raise RuntimeError("no free rollout slot; check free_slots() before submit()")
        self._assigned[i].add(req.rid)
        self._queues[i].put(req)

    def poll(self, timeout_s: float) -> PollResult:
        out = PollResult()
        drain(self._results, timeout_s, out, self._assigned, self._stats, self._seen)
        self._check_alive(out)
        return out

    def engine_stats(self) -> dict[int, dict]:
        return dict(self._stats)

    def shutdown(self, grace_s: float = 5.0) -> None:
        for q in self._queues:
            if q is not None:
                q.put(None)
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            if p is not None:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(1.0)


__all__ = ["Backend", "LocalBackend", "WorkerFailure", "collect", "drain"]
