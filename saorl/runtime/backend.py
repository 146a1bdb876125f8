"""Where rollout workers run. The local backend: one OS process per worker on this machine.

A backend takes :class:`~saorl.runtime.worker.RolloutRequest` s, returns finished trajectories
as they arrive, and keeps its workers alive: a worker that dies is restarted and the rollout ids
it held are reported as lost, so the trainer re-queues them (nothing in flight is skipped).
The Ray backend implements the same :class:`Backend` protocol with actors.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field
from typing import Protocol

from saorl.data.trajectory import Trajectory
from saorl.runtime.worker import RolloutRequest, WorkerSpec, worker_main


@dataclass
class PollResult:
    finished: list[tuple[int, Trajectory]] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    """Rollout ids whose worker died (or whose episode raised) before finishing them."""
    errors: list[str] = field(default_factory=list)


class Backend(Protocol):
    def start(self) -> None: ...

    def free_slots(self) -> int: ...

    def submit(self, req: RolloutRequest) -> None: ...

    def poll(self, timeout_s: float) -> PollResult: ...

    def engine_stats(self) -> dict[int, dict]: ...

    def shutdown(self) -> None: ...


class WorkerFailure(RuntimeError):
    """A worker keeps crashing; restarting it again would only hide the bug."""


class LocalBackend:
    def __init__(self, spec: WorkerSpec, num_workers: int, concurrency: int, max_restarts: int = 5) -> None:
        self.spec, self.num_workers, self.concurrency = spec, num_workers, concurrency
        self.max_restarts = max_restarts
        self._ctx = mp.get_context("spawn")
        self._results = self._ctx.Queue()
        self._procs: list = [None] * num_workers
        self._queues: list = [None] * num_workers
        self._assigned: list[set[int]] = [set() for _ in range(num_workers)]
        self._stats: dict[int, dict] = {}
        self.restarts = 0

    # ---------------------------------------------------------------- workers
    def _spawn(self, i: int) -> None:
        q = self._ctx.Queue()
        p = self._ctx.Process(target=worker_main, args=(i, self.spec, q, self._results),
                              name=f"saorl-rollout-{i}", daemon=True)
        p.start()
        self._procs[i], self._queues[i] = p, q

    def start(self) -> None:
        for i in range(self.num_workers):
            self._spawn(i)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _check_alive(self, out: PollResult) -> None:
        for i, p in enumerate(self._procs):
            if p is not None and not p.is_alive():
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    raise WorkerFailure(f"rollout worker {i} died (exit code {p.exitcode}); "
                                        f"{self.restarts} restarts so far, giving up")
                out.errors.append(f"rollout worker {i} died (exit code {p.exitcode}); restarted, "
                                  f"{len(self._assigned[i])} rollouts re-queued")
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
        deadline = time.monotonic() + timeout_s
        block = True
        while True:
            try:
                remaining = max(0.0, deadline - time.monotonic())
                msg = self._results.get(block, remaining) if block else self._results.get_nowait()
            except queue.Empty:
                break
            block = False  # after the first message, drain without waiting
            kind, wid, rid, payload = msg
            if kind == "traj":
                self._assigned[wid].discard(rid)
                out.finished.append((rid, Trajectory.from_dict(payload)))
            elif kind == "error":
                self._assigned[wid].discard(rid)
                out.lost.append(rid)
                out.errors.append(f"rollout {rid} on worker {wid} failed: {payload}")
            elif kind == "stats":
                self._stats[wid] = payload
            elif kind == "fatal":
                out.errors.append(f"rollout worker {wid} crashed: {payload}")
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
