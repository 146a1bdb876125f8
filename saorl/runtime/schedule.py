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

A feeder thread does all the talking to the backend (dispatch, receive, journal), so rollouts
are collected and slots refilled *while* the trainer computes, not only between steps; the
trainer thread only waits for a batch and takes it. Torch releases the GIL in its kernels, so
the two threads overlap. The journal is written (and fsynced once per arrival batch) by the
feeder, off the trainer's critical path.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from saorl.data.task import Task
from saorl.data.trajectory import Trajectory
from saorl.envs.base import Progress
from saorl.errors import RunFailure
from saorl.runtime.backends.base import Backend
from saorl.runtime.backends.messages import PollResult, RolloutRequest
from saorl.runtime.journal import Journal, RolloutCursor
from saorl.runtime.observe import Observer

TIMEOUTS_IN_A_ROW = 8
"""Rollouts past ``env.call_timeout_s`` in a row, none finished in between, that stop the run: user
code that hangs on every call stops it after a wave or two of deadlines, not after each rollout's
four tries (minutes each)."""


class DispatchPolicy(Protocol):
    def to_dispatch(self, free_slots: int, in_flight: int, buffered: int, batch_size: int,
                    trainer_waiting: bool) -> int: ...

    def min_version(self, learner_version: int) -> int: ...


class AsyncDispatch:
    def to_dispatch(self, free_slots: int, in_flight: int, buffered: int, batch_size: int,
                    trainer_waiting: bool) -> int:
        # at most one batch waiting beyond what the slots hold: the trainer never starves, and a
        # backlog of stale trajectories never builds up
        return max(0, min(free_slots, free_slots + batch_size - buffered))

    def min_version(self, learner_version: int) -> int:
        return 0


class SyncDispatch:
    def to_dispatch(self, free_slots: int, in_flight: int, buffered: int, batch_size: int,
                    trainer_waiting: bool) -> int:
        if not trainer_waiting:  # the barrier: the next batch waits for the new weights
            return 0
        return max(0, min(free_slots, batch_size - in_flight - buffered))

    def min_version(self, learner_version: int) -> int:
        return learner_version


@dataclass
class FeedStats:
    wait_s: float = 0.0
    dropped_stale: int = 0
    requeued: int = 0
    finished: int = 0


def _feed_failed(error: BaseException) -> RuntimeError:
    """The feeder thread's error, raised again on the trainer's thread (a RunFailure stays one)."""
    return (RunFailure if isinstance(error, RunFailure) else RuntimeError)(f"rollout feed failed: {error}")


class RolloutFeed:
    """Rollout ids out, finished trajectories in, batches to the trainer. Thread-safe."""

    def __init__(self, backend: Backend, tasks: list[Task], cursor: RolloutCursor, journal: Journal,
                 policy: DispatchPolicy, *, group_size: int, batch_size: int,
                 version: Callable[[], int], progress: Callable[[], Progress],
                 max_staleness: int | None = None, log: Callable[[str], None] = print,
                 log_error: Callable[[str], None] | None = None, observer: Observer | None = None,
                 staleness: Callable[[Trajectory, int], int] = Trajectory.staleness) -> None:
        if batch_size % group_size:
            raise ValueError(f"batch_size {batch_size} must be a multiple of group_size {group_size}")
        self.backend, self.tasks, self.cursor, self.journal = backend, tasks, cursor, journal
        self.policy, self.group_size, self.batch_size = policy, group_size, batch_size
        self.max_staleness, self.log = max_staleness, log
        self.staleness = staleness
        """A trajectory's staleness at a trainer version (a resumed run's skips the versions it discarded:
        :class:`~saorl.runtime.resume.Lineage`)."""
        self.log_error = log_error or log  # a failed rollout's error (with its traceback)
        self.observer = observer or Observer()
        self._version, self._progress = version, progress
        self.groups: OrderedDict[int, dict[int, Trajectory]] = OrderedDict()  # seq -> {rid: traj}
        self.stats = FeedStats()
        self._failures: dict[int, int] = {}
        self._timeouts_in_a_row = 0  # rollouts past env.call_timeout_s since one last finished
        self._cond = threading.Condition()
        self._waiting = False
        self._error: BaseException | None = None
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- bookkeeping
    def group_of(self, rid: int) -> int:
        """The group of rollout ``rid`` (see :mod:`saorl.runtime.journal`), given to the worker
        with the request and carried back on ``episode.group``; the one place it is computed."""
        return rid // self.group_size

    def task_for(self, rid: int) -> Task:
        return self.tasks[self.group_of(rid) % len(self.tasks)]

    def _buffer(self, traj: Trajectory) -> None:
        ep = traj.episode
        group = ep.group if ep.group >= 0 else self.group_of(ep.rid)  # journalled before episodes had it
        self.groups.setdefault(group, {})[ep.rid] = traj

    def restore_pending(self, pending: list[Trajectory]) -> None:
        with self._cond:
            for traj in pending:
                self._buffer(traj)

    def _pending(self) -> list[Trajectory]:
        return [t for g in self.groups.values() for t in g.values()]

    def checkpoint_state(self) -> tuple[list[list[int]], list[Trajectory], int]:
        """Finished rollout ranges, finished-but-untrained trajectories and the journal segment
        that starts after them, taken together so that a checkpoint is consistent."""
        with self._cond:
            return self.cursor.finished.ranges(), self._pending(), self.journal.rotate()

    def _buffered(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def _complete_groups(self) -> list[int]:
        return [s for s, g in self.groups.items() if len(g) == self.group_size]

    # ---------------------------------------------------------- feeder thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._feed, name="saorl-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _feed(self) -> None:
        try:
            while not self._halt.is_set():
                with self._cond:
                    self._dispatch()
                res = self.backend.poll(0.05)  # blocks: outside the lock
                with self._cond:
                    self._apply(res)
                    self._cond.notify_all()
        except BaseException as e:  # surfaced in the trainer thread by next_batch
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _dispatch(self) -> None:
        n = self.policy.to_dispatch(self.backend.free_slots(), len(self.cursor.in_flight),
                                    self._buffered(), self.batch_size, self._waiting)
        if n <= 0:
            return
        progress, min_version = self._progress(), self.policy.min_version(self._version())
        for _ in range(n):
            rid = self.cursor.next()
            self.backend.submit(RolloutRequest(rid, self.task_for(rid), progress, min_version,
                                               group=self.group_of(rid)))
            self.observer.rollout_dispatched(rid, time.time())

    def _apply(self, res: PollResult) -> None:
        for msg in res.errors:
            self.log_error(f"[rollout] {msg}")
        if res.finished:
            self._timeouts_in_a_row = 0
        self._timeouts_in_a_row += len(res.timeouts)
        if self._timeouts_in_a_row >= TIMEOUTS_IN_A_ROW:
            last = res.timeouts[max(res.timeouts)]
            raise RunFailure(f"the last {self._timeouts_in_a_row} rollouts all ran past env.call_timeout_s "
                             f"and none finished in between, so user code seems to hang on every call: "
                             f"{last}. Fix the function (or the env), or raise env.call_timeout_s if it "
                             "needs longer")
        for rid in res.lost:
            self._failures[rid] = self._failures.get(rid, 0) + 1
            if self._failures[rid] > 3:
                last = res.timeouts.get(rid)  # a call into user code past env.call_timeout_s
                raise RunFailure(f"rollout {rid} (task {self.task_for(rid).id}) failed 4 times"
                                 + (f", the last time: {last}" if last else "")
                                 + "; see the log above (and errors.log) for its errors")
            self.cursor.requeue(rid)
            self.stats.requeued += 1
        if res.finished:  # durable before anything else sees them
            self.journal.append_many(res.finished)
            self.observer.rollouts_finished(res.finished)
        for traj in res.finished:
            self.cursor.finish(traj.episode.rid)
            self.stats.finished += 1
            self._buffer(traj)

    # ----------------------------------------------------------- trainer side
    def raise_if_failed(self) -> None:
        """Raise the feeder thread's error, if it died of one."""
        with self._cond:
            if self._error is not None:
                raise _feed_failed(self._error) from self._error

    def next_batch(self, learner_version: int, should_stop=lambda: False):
        """Block until ``batch_size`` trajectories (whole groups) are ready; return them.

        Returns ``(trajectories, group_ids, wait_s)``, or None if ``should_stop()`` became true.
        Groups staler than ``max_staleness`` are dropped (counted) and the wait goes on.
        """
        t0 = time.monotonic()
        trajs: list[Trajectory] = []
        gids: list[int] = []
        with self._cond:
            self._waiting = True
            try:
                while len(trajs) < self.batch_size:
                    if self._error is not None:
                        raise _feed_failed(self._error) from self._error
                    ready = self._complete_groups()
                    if len(ready) * self.group_size < self.batch_size - len(trajs):
                        if should_stop():
                            return None
                        self._cond.wait(0.1)
                        continue
                    for seq in ready[: (self.batch_size - len(trajs)) // self.group_size]:
                        group = self.groups.pop(seq)
                        stale = max(self.staleness(t, learner_version) for t in group.values())
                        if self.max_staleness is not None and stale > self.max_staleness:
                            self.stats.dropped_stale += len(group)
                            continue
                        for rid in sorted(group):
                            trajs.append(group[rid])
                            gids.append(seq)
            finally:
                self._waiting = False
        wait = time.monotonic() - t0
        self.stats.wait_s += wait
        return trajs, gids, wait
