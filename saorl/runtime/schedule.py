"""Turning a stream of finished rollouts into training batches: asynchronous or synchronous.

:class:`RolloutFeed` owns the rollout cursor, the journal and the group buffer; it is the only
place that talks to the backend. A :class:`DispatchPolicy` says how many rollouts to have in
flight and with which weights:

- :class:`AsyncDispatch` (SAO): keep every worker slot busy; sample with the newest weights a
  worker has. A batch is the first ``batch_size`` trajectories (or complete groups) to finish;
  stragglers finish later and go into a later batch. Finished-but-untrained trajectories count
  against the slots: when the trainer is the bottleneck, running further ahead would only make
  the data staler, so rollouts pause until the trainer catches up (staleness stays bounded by
  about ``slots / batch_size`` versions instead of growing for the whole run).
- :class:`SyncDispatch` (GRPO / VAPO / PPO baselines): dispatch exactly one batch, all sampled
  with the current weights, and wait for all of it (the barrier); workers idle during training.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from saorl.data.trajectory import Trajectory
from saorl.envs.base import Progress, Task
from saorl.runtime.backend import Backend
from saorl.runtime.journal import Journal, RolloutCursor
from saorl.runtime.worker import RolloutRequest


class DispatchPolicy(Protocol):
    def to_dispatch(self, free_slots: int, in_flight: int, buffered: int, batch_size: int) -> int: ...

    def min_version(self, learner_version: int) -> int: ...


class AsyncDispatch:
    def to_dispatch(self, free_slots: int, in_flight: int, buffered: int, batch_size: int) -> int:
        # at most one batch waiting beyond what the slots hold: the trainer never starves, and a
        # backlog of stale trajectories never builds up
        return max(0, min(free_slots, free_slots + batch_size - buffered))

    def min_version(self, learner_version: int) -> int:
        return 0


class SyncDispatch:
    def to_dispatch(self, free_slots: int, in_flight: int, buffered: int, batch_size: int) -> int:
        return max(0, min(free_slots, batch_size - in_flight - buffered))

    def min_version(self, learner_version: int) -> int:
        return learner_version


@dataclass
class FeedStats:
    wait_s: float = 0.0
    dropped_stale: int = 0
    requeued: int = 0
    finished: int = 0


class RolloutFeed:
    def __init__(self, backend: Backend, tasks: list[Task], cursor: RolloutCursor, journal: Journal,
                 policy: DispatchPolicy, *, group_size: int, batch_size: int,
                 max_staleness: int | None = None, log=print) -> None:
        if batch_size % group_size:
            raise ValueError(f"batch_size {batch_size} must be a multiple of group_size {group_size}")
        self.backend, self.tasks, self.cursor, self.journal = backend, tasks, cursor, journal
        self.policy, self.group_size, self.batch_size = policy, group_size, batch_size
        self.max_staleness, self.log = max_staleness, log
        self.groups: OrderedDict[int, dict[int, Trajectory]] = OrderedDict()  # seq -> {rid: traj}
        self.stats = FeedStats()
        self._failures: dict[int, int] = {}

    # -------------------------------------------------------------- bookkeeping
    def task_for(self, rid: int) -> Task:
        return self.tasks[(rid // self.group_size) % len(self.tasks)]

    def restore_pending(self, pending: list[tuple[int, Trajectory]]) -> None:
        for rid, traj in pending:
            self.groups.setdefault(rid // self.group_size, {})[rid] = traj

    def pending(self) -> list[tuple[int, Trajectory]]:
        return [(rid, t) for g in self.groups.values() for rid, t in g.items()]

    def _buffered(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def _complete_groups(self) -> list[int]:
        return [s for s, g in self.groups.items() if len(g) == self.group_size]

    # ----------------------------------------------------------------- the feed
    def _dispatch(self, learner_version: int, progress: Progress) -> None:
        n = self.policy.to_dispatch(self.backend.free_slots(), len(self.cursor.in_flight),
                                    self._buffered(), self.batch_size)
        for _ in range(n):
            rid = self.cursor.next()
            self.backend.submit(RolloutRequest(rid, self.task_for(rid), progress,
                                               self.policy.min_version(learner_version)))

    def _receive(self, timeout_s: float, learner_version: int) -> None:
        res = self.backend.poll(timeout_s)
        for msg in res.errors:
            self.log(f"[rollout] {msg}")
        for rid in res.lost:
            self._failures[rid] = self._failures.get(rid, 0) + 1
            if self._failures[rid] > 3:
                raise RuntimeError(f"rollout {rid} (task {self.task_for(rid).id}) failed 4 times; "
                                   "see the log")
            self.cursor.requeue(rid)
            self.stats.requeued += 1
        for rid, traj in res.finished:
            self.journal.append(rid, traj)
            self.cursor.finish(rid)
            self.stats.finished += 1
            self.groups.setdefault(rid // self.group_size, {})[rid] = traj

    def next_batch(self, learner_version: int, progress: Progress, should_stop=lambda: False):
        """Block until ``batch_size`` trajectories (whole groups) are ready; return them.

        Returns ``(trajectories, group_ids, wait_s)``, or None if ``should_stop()`` became true.
        """
        t0 = time.monotonic()
        while True:
            ready = self._complete_groups()
            if len(ready) * self.group_size >= self.batch_size:
                break
            if should_stop():
                return None
            self._dispatch(learner_version, progress)
            self._receive(0.05, learner_version)
        trajs, gids = [], []
        for seq in ready[: self.batch_size // self.group_size]:
            group = self.groups.pop(seq)
            stale = [t.staleness(learner_version) for t in group.values()]
            if self.max_staleness is not None and max(stale) > self.max_staleness:
                self.stats.dropped_stale += len(group)
                continue
            for rid in sorted(group):
                trajs.append(group[rid])
                gids.append(seq)
        wait = time.monotonic() - t0
        self.stats.wait_s += wait
        if not trajs:  # everything was too stale: the caller asks again
            return self.next_batch(learner_version, progress, should_stop)
        return trajs, gids, wait

    def keep_busy(self, learner_version: int, progress: Progress) -> None:
        """Top up the workers and collect what finished, without waiting (called around training)."""
        self._dispatch(learner_version, progress)
        self._receive(0.0, learner_version)
