"""The seam of where rollout workers run: the :class:`Backend` protocol, the failure of a worker that
keeps crashing, and how a backend folds its workers' messages into a
:class:`~saorl.runtime.backends.messages.PollResult` (:func:`drain`, :func:`collect`).

Implementations: :class:`~saorl.runtime.backends.local.LocalBackend` (worker processes on this
machine), :class:`~saorl.runtime.backends.inprocess.InProcessBackend` (episodes on one engine in
this process) and :class:`~saorl.runtime.backends.ray_actors.RayBackend` (Ray actors).
"""

from __future__ import annotations

import queue
import time
from typing import Protocol

from saorl.errors import RunFailure
from saorl.runtime.backends.messages import (
    EngineStats,
    PollResult,
    RolloutFailed,
    RolloutFinished,
    RolloutRequest,
    WorkerCrashed,
)


class Backend(Protocol):
    restarts: int
    """Workers restarted after dying, so far."""

    def start(self) -> None:
        """Start the workers (returns at once; :meth:`ready` tells when they can sample)."""
        ...

    def ready(self) -> bool:
        """Whether every worker has built its engine (the run's wall-clock budget starts then)."""
        ...

    def free_slots(self) -> int:
        """Rollouts that can be submitted now."""
        ...

    def submit(self, req: RolloutRequest) -> None: ...

    def poll(self, timeout_s: float) -> PollResult:
        """What arrived within ``timeout_s`` (returns at the first arrival, with all that is there)."""
        ...

    def engine_stats(self) -> dict[int, dict]:
        """The latest ``InferenceEngine.stats()`` of each worker, by worker index."""
        ...

    def shutdown(self) -> None: ...


class WorkerFailure(RunFailure):
    """A worker keeps crashing; restarting it again would only hide the bug."""


def drain(results, timeout_s: float, out: PollResult, assigned: list[set[int]],
          stats: dict[int, dict], seen: list[float | None] | None = None) -> None:
    """Wait up to ``timeout_s`` for a first message on the ``results`` queue, then take every
    message already there without waiting, folding each into ``out`` (:func:`collect`); ``seen``:
    when each worker's last message was read."""
    deadline = time.monotonic() + timeout_s
    block = True
    while True:
        try:
            remaining = max(0.0, deadline - time.monotonic())
            msg = results.get(True, remaining) if block else results.get_nowait()
        except queue.Empty:
            return
        block = False
        collect(msg, out, assigned, stats)
        if seen is not None:
            seen[msg.worker] = time.monotonic()


def collect(msg, out: PollResult, assigned: list[set[int]], stats: dict[int, dict]) -> None:
    """Fold one worker message into ``out``, the per-worker rollout sets and the engine stats."""
    if isinstance(msg, RolloutFinished):
        assigned[msg.worker].discard(msg.rid)
        out.finished.append(msg.trajectory)
    elif isinstance(msg, RolloutFailed):
        assigned[msg.worker].discard(msg.rid)
        out.lost.append(msg.rid)
        out.errors.append(f"rollout {msg.rid} on worker {msg.worker} failed: {msg.error}")
        if msg.timed_out:
            out.timeouts[msg.rid] = msg.error.split("\n", 1)[0]
    elif isinstance(msg, EngineStats):
        stats[msg.worker] = msg.stats
    elif isinstance(msg, WorkerCrashed):
        out.errors.append(f"rollout worker {msg.worker} crashed: {msg.error}")
    else:
        raise TypeError(f"unexpected worker message {type(msg).__name__}")
