"""Discrete-event simulator of the RL pipeline: rollout engines → trajectory queue → trainer → weights.

What is simulated (an event heap; time jumps from event to event, nothing is time-stepped):

- ``engines`` engines with ``slots`` decode slots each. While ``b`` trajectories are decoding in
  an engine, each advances one token per ``step_time(b)`` seconds (``params.decode``). Decode is
  modelled as a *fluid*: all decoding trajectories of an engine share one token counter, so a
  turn that needs ``n`` tokens ends exactly ``n`` steps after it started when ``b`` is constant;
  a trajectory that joins mid-step starts at once instead of at the next step boundary (an error
  of at most one step per join). Prefill and observation tokens are not modelled.
- A trajectory holds its slot from dispatch to its end, including the environment latency
  between turns (it does not decode then, so it does not count in ``b`` nor in slot utilisation).
- Lengths: each trajectory draws its own (``group_lengths="independent"``), or the members of a
  group share their group's draw (``"shared"``: the task fixes the length).
- One trainer. A step on ``n`` action tokens takes ``train_a + train_b·n`` seconds, then weights
  are published (``publish_s``, trainer blocked); the version seen by newly started trajectories
  goes up by one when publication ends. An engine picks up new weights only for trajectories it
  starts afterwards (per-trajectory versions; the real system can switch between turns).
- ``sync`` (the GRPO/PPO baselines' :class:`~saorl.runtime.schedule.SyncDispatch`): dispatch
  ``batch_size/G`` prompts × ``G`` with the current weights (onto the least-loaded engines; extra
  ones wait for a free slot), wait for all of them (the barrier), train, publish, repeat. Engines
  idle while stragglers finish, while training and while publishing. Staleness is always 0.
- ``async`` (SAO, :class:`~saorl.runtime.schedule.AsyncDispatch`): every free slot is refilled at
  once with the newest published weights; whenever the trainer is free and ``batch_size``
  trajectories in complete groups are queued, it takes the first ones (in order of their group's
  first finish), drops the groups with a member staler than ``max_staleness`` (counted) and
  trains on the rest, like :meth:`~saorl.runtime.schedule.RolloutFeed.next_batch`.
  Staleness = trainer version at train time − version the trajectory started with.
- ``shared_resources`` (co-location, e.g. the 2-core laptop): while the trainer trains, decode
  steps take ``contention``× longer, and while any engine decodes, training progresses
  ``contention``× slower. A crude stand-in for CPU/GPU time sharing: it ignores how many engines
  decode and memory-bandwidth effects; publication is not slowed.

Ties at one instant resolve trainer events first, then engine events, then slot refills, so a
trainer with zero cost publishes before the freed slots are refilled (staleness 0, as intended).
"""

from __future__ import annotations

import gc
import heapq
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from saorl.sim.params import SimInputError, SimParams

Mode = Literal["sync", "async"]
_TRAIN_DONE, _PUBLISHED, _ENGINE, _ENV_RETURN, _REFILL = range(5)
_PRIO = {_TRAIN_DONE: 0, _PUBLISHED: 0, _ENGINE: 1, _ENV_RETURN: 1, _REFILL: 2}
_TOL = 1e-6  # tokens: a turn is finished when the engine counter is within this of its target


@dataclass
class SimResult:
    """Aggregates over ``[0, duration_s]``; rates are per second of simulated time."""

    mode: str
    duration_s: float
    steps: int
    trained_trajectories: int
    trained_tokens: int
    finished_trajectories: int
    dropped: int
    dropped_tokens: int
    trajectories_per_s: float
    tokens_per_s: float
    trainer_idle_frac: float
    slot_util: float
    staleness_mean: float
    staleness_p50: float
    staleness_p90: float
    staleness_max: int
    staleness_hist: list[int] = field(default_factory=list)
    """``staleness_hist[k]`` = trained trajectories with staleness ``k``."""

    def as_dict(self) -> dict:
        return asdict(self)


class _Traj:
    __slots__ = ("gid", "tokens", "turns", "version")

    def __init__(self, gid: int, length: int, turns: int, version: int) -> None:
        n = min(turns, length)
        base, extra = divmod(length, n)
        self.gid, self.tokens, self.version = gid, length, version
        self.turns = [base + (1 if i < extra else 0) for i in range(n)][::-1]  # pop() = next turn


class _Engine:
    __slots__ = ("busy_s", "decoding", "dt", "gen", "i", "occupied", "progress", "t", "targets")

    def __init__(self, i: int) -> None:
        self.i, self.t, self.progress, self.dt = i, 0.0, 0.0, 0.0
        self.targets: list = []  # heap of (progress at which the current turn ends, seq, traj)
        self.decoding = self.occupied = self.gen = 0
        self.busy_s = 0.0  # decoding slot-seconds


class _Sim:
    def __init__(self, p: SimParams, mode: Mode, duration_s: float, seed: int) -> None:
        if mode not in ("sync", "async"):
            raise SimInputError(f"mode {mode!r}: use 'sync' or 'async'")
        if not duration_s > 0:
            raise SimInputError(f"duration_s must be > 0, got {duration_s}")
        self.p, self.mode, self.end = p, mode, float(duration_s)
        self.draw = p.lengths.sampler(np.random.default_rng(seed))
        self.table = p.decode.table(p.slots)
        self.engines = [_Engine(i) for i in range(p.engines)]
        self.events: list = []
        self.seq, self.now = 0, 0.0
        self.version = self.next_rid = 0
        self.group_len = 0  # the length of the group being dispatched (``group_lengths="shared"``)
        self.groups: dict[int, tuple[int, list[_Traj]]] = {}  # gid -> (first-finish order, members)
        self.ready: list[tuple[int, int]] = []  # heap of (first-finish order, gid) of complete groups
        self.finish_order = 0
        self.pending: list[_Traj] = []  # sync: dispatched, waiting for a free slot
        self.active_engines = 0  # engines with ≥ 1 trajectory decoding
        self.trainer = "idle"  # idle | training | publishing
        self.train_left = self.train_t = 0.0  # full-speed seconds left, last update time
        self.train_gen = 0
        self.trainer_due = float("inf")  # time of the pending trainer event
        self.idle_since, self.idle_s = 0.0, 0.0
        self.batch: list[_Traj] = []
        self.stale: list[int] = []
        self.steps = self.trained = self.trained_tokens = self.finished = 0
        self.dropped = self.dropped_tokens = 0

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: int, a=None, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, _PRIO[kind], self.seq, kind, a, b))

    def run(self) -> SimResult:
        if self.mode == "async":
            for e in self.engines:
                self.on_refill(e)
        else:
            self.dispatch_sync_batch()
        handlers = {_ENGINE: self.on_engine, _ENV_RETURN: self.on_env_return, _REFILL: self.on_refill,
                    _TRAIN_DONE: self.on_train_done, _PUBLISHED: self.on_published}
        ev = self.events
        while ev and ev[0][0] <= self.end:
            t, _, _, kind, a, b = heapq.heappop(ev)
            self.now = t
            handlers[kind](a, b)
        self.now = self.end
        for e in self.engines:
            self.advance(e)
        if self.trainer == "idle":
            self.idle_s += self.end - self.idle_since
        return self.result()

    # ----------------------------------------------------------------- engines
    def slowdown(self) -> float:
        return self.p.contention if self.p.shared_resources and self.trainer == "training" else 1.0

    def advance(self, e: _Engine) -> None:
        if e.decoding:
            span = self.now - e.t
            e.progress += span / e.dt
            e.busy_s += e.decoding * span
        e.t = self.now

    def reschedule(self, e: _Engine) -> None:
        """Call after :meth:`advance`: new rate for the current batch, next turn end on the heap."""
        e.gen += 1
        if e.decoding:
            e.dt = self.table[e.decoding] * self.slowdown()
            left = max(0.0, e.targets[0][0] - e.progress)
            self.push(e.t + left * e.dt, _ENGINE, e, e.gen)

    def set_decoding(self, e: _Engine, n: int) -> None:
        was = e.decoding > 0
        e.decoding = n
        if was != (n > 0):
            old = self.active_engines
            self.active_engines += 1 if n > 0 else -1
            flipped = (old == 0) != (self.active_engines == 0)
            if flipped and self.p.shared_resources and self.trainer == "training":
                self.retime_trainer(old)

    def start_turn(self, e: _Engine, tr: _Traj) -> None:
        """Needs ``e`` advanced to now; the caller reschedules."""
        self.seq += 1
        heapq.heappush(e.targets, (e.progress + tr.turns.pop(), self.seq, tr))
        self.set_decoding(e, e.decoding + 1)

    def place(self, e: _Engine, tr: _Traj) -> None:
        e.occupied += 1
        self.start_turn(e, tr)

    def on_engine(self, e: _Engine, gen: int) -> None:
        if gen != e.gen:
            return
        self.advance(e)
        done = []
        while e.targets and e.targets[0][0] <= e.progress + _TOL:
            done.append(heapq.heappop(e.targets)[2])
        self.set_decoding(e, e.decoding - len(done))
        for tr in done:
            if tr.turns:
                if self.p.env_latency_s > 0:
                    self.push(self.now + self.p.env_latency_s, _ENV_RETURN, e, tr)
                else:
                    self.start_turn(e, tr)
            else:
                e.occupied -= 1
                self.deliver(tr)
        if e.occupied < self.p.slots:
            if self.trainer_due <= self.now:  # let the trainer publish first (see the docstring)
                self.push(self.now, _REFILL, e)
            else:
                self.fill(e)
        self.reschedule(e)

    def on_env_return(self, e: _Engine, tr: _Traj) -> None:
        self.advance(e)
        self.start_turn(e, tr)
        self.reschedule(e)

    def on_refill(self, e: _Engine, _b=None) -> None:
        self.advance(e)
        self.fill(e)
        self.reschedule(e)

    def fill(self, e: _Engine) -> None:
        """Async: fill every free slot with a new trajectory; sync: with waiting ones of the batch."""
        if self.mode == "async":
            while e.occupied < self.p.slots:
                self.place(e, self.new_traj())
        else:
            while self.pending and e.occupied < self.p.slots:
                self.place(e, self.pending.pop())

    def new_traj(self) -> _Traj:
        gid = self.next_rid // self.p.group_size
        if self.p.group_lengths == "independent" or self.next_rid % self.p.group_size == 0:
            self.group_len = self.draw()
        self.next_rid += 1
        return _Traj(gid, self.group_len, self.p.turns, self.version)

    def dispatch_sync_batch(self) -> None:
        trajs = [self.new_traj() for _ in range(self.p.batch_size)]
        free = [(e.occupied, e.i) for e in self.engines if e.occupied < self.p.slots]
        heapq.heapify(free)
        touched = set()
        for tr in trajs:
            if not free:
                self.pending.append(tr)
                continue
            occ, i = heapq.heappop(free)
            e = self.engines[i]
            if i not in touched:
                self.advance(e)
                touched.add(i)
            self.place(e, tr)
            if occ + 1 < self.p.slots:
                heapq.heappush(free, (occ + 1, i))
        self.pending.reverse()  # pop() gives dispatch order
        for i in touched:
            self.reschedule(self.engines[i])

    # ----------------------------------------------------------------- trainer
    def deliver(self, tr: _Traj) -> None:
        self.finished += 1
        if tr.gid not in self.groups:
            self.finish_order += 1
            self.groups[tr.gid] = (self.finish_order, [])
        order, members = self.groups[tr.gid]
        members.append(tr)
        if len(members) == self.p.group_size:
            heapq.heappush(self.ready, (order, tr.gid))
        if self.trainer == "idle":
            self.try_train()

    def take_batch(self) -> list[_Traj] | None:
        need = self.p.batch_size // self.p.group_size
        while True:
            if len(self.ready) < need:
                return None
            gids = [heapq.heappop(self.ready)[1] for _ in range(need)]
            if self.mode == "sync":
                return [t for g in gids for t in self.groups.pop(g)[1]]
            batch = []
            for g in gids:
                members = self.groups.pop(g)[1]
                limit = self.p.max_staleness
                if limit is not None and max(self.version - t.version for t in members) > limit:
                    self.dropped += len(members)
                    self.dropped_tokens += sum(t.tokens for t in members)
                else:
                    batch.extend(members)
            if batch:
                return batch

    def try_train(self) -> None:
        batch = self.take_batch()
        if batch is None:
            return
        self.idle_s += self.now - self.idle_since
        self.batch = batch
        self.train_left = self.p.train_time(sum(t.tokens for t in batch))
        self.train_t = self.now
        self.trainer = "training"
        self.engines_retimed()
        self.retime_trainer(self.active_engines)

    def train_rate(self, active_engines: int) -> float:
        return 1.0 / self.p.contention if self.p.shared_resources and active_engines else 1.0

    def retime_trainer(self, old_active: int) -> None:
        """Book progress at the rate that held since the last update, then reschedule the step's end."""
        self.train_left = max(0.0, self.train_left - (self.now - self.train_t) * self.train_rate(old_active))
        self.train_t = self.now
        self.train_gen += 1
        self.trainer_due = self.now + self.train_left / self.train_rate(self.active_engines)
        self.push(self.trainer_due, _TRAIN_DONE, self.train_gen)

    def engines_retimed(self) -> None:
        if self.p.shared_resources:  # the decode rate of every engine just changed
            for e in self.engines:
                self.advance(e)
                self.reschedule(e)

    def on_train_done(self, gen: int, _b=None) -> None:
        if gen != self.train_gen or self.trainer != "training":
            return
        self.trainer = "publishing"
        self.engines_retimed()
        self.steps += 1
        self.trained += len(self.batch)
        self.trained_tokens += sum(t.tokens for t in self.batch)
        self.stale.extend(self.version - t.version for t in self.batch)  # version unchanged since start
        self.batch = []
        self.trainer_due = self.now + self.p.publish_s
        self.push(self.trainer_due, _PUBLISHED)

    def on_published(self, _a=None, _b=None) -> None:
        self.version += 1
        self.trainer, self.trainer_due = "idle", float("inf")
        self.idle_since = self.now
        if self.mode == "sync":
            self.dispatch_sync_batch()
        self.try_train()

    # ------------------------------------------------------------------ result
    def result(self) -> SimResult:
        d, p = self.end, self.p
        st = np.asarray(self.stale, dtype=float)
        has = st.size > 0
        hist = np.bincount(st.astype(int)).tolist() if has else []
        busy = sum(e.busy_s for e in self.engines)
        return SimResult(
            mode=self.mode, duration_s=d, steps=self.steps, trained_trajectories=self.trained,
            trained_tokens=self.trained_tokens, finished_trajectories=self.finished,
            dropped=self.dropped, dropped_tokens=self.dropped_tokens,
            trajectories_per_s=self.trained / d, tokens_per_s=self.trained_tokens / d,
            trainer_idle_frac=self.idle_s / d, slot_util=busy / (p.engines * p.slots * d),
            staleness_mean=float(st.mean()) if has else 0.0,
            staleness_p50=float(np.percentile(st, 50)) if has else 0.0,
            staleness_p90=float(np.percentile(st, 90)) if has else 0.0,
            staleness_max=int(st.max()) if has else 0, staleness_hist=hist)


def simulate(params: SimParams, mode: Mode, duration_s: float, seed: int = 0) -> SimResult:
    """Run the pipeline for ``duration_s`` simulated seconds in ``mode``; deterministic in ``seed``."""
    # The simulation makes no reference cycles; the cyclic GC only rescans the many live
    # trajectories (3× slower at 1,024 engines), so it is paused for the run.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Sim(params, mode, duration_s, seed).run()
    finally:
        if was_enabled:
            gc.enable()


def compare(params: SimParams, duration_s: float, seed: int = 0) -> dict:
    """Sync and async on the same workload (same seed), and async/sync ratios.

    Returns ``{"sync": SimResult, "async": SimResult, "ratio_tokens_per_s": float,
    "ratio_trajectories_per_s": float}`` (a ratio is ``inf`` when sync trained nothing).
    """
    s = simulate(params, "sync", duration_s, seed)
    a = simulate(params, "async", duration_s, seed)

    def ratio(x: float, y: float) -> float:
        return x / y if y > 0 else float("inf")

    return {"sync": s, "async": a, "ratio_tokens_per_s": ratio(a.tokens_per_s, s.tokens_per_s),
            "ratio_trajectories_per_s": ratio(a.trajectories_per_s, s.trajectories_per_s)}
