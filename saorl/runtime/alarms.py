"""Alarms while a run goes wrong: one console line the step trouble starts, not only the
end-of-run summary (:mod:`saorl.runtime.run_signals`, whose thresholds these are).

:class:`RunAlarms` reads each step's metrics row (:meth:`RunAlarms.observe`) and returns an
:class:`Alarm` for each kind of trouble that *starts* at that step:

- ``drift burst``: ``mismatch/kl`` above :data:`~saorl.runtime.run_signals.DRIFT_KL`, or
  ``policy/dis_kept_frac`` below :data:`~saorl.runtime.run_signals.DIS_KEPT_MIN` — the policy
  moved far from the one that sampled (a learning rate too large is the usual cause);
- ``action-length collapse``: ``rollout/action_tokens_mean`` below
  :data:`~saorl.runtime.run_signals.LENGTH_COLLAPSE_FRAC` of its median over the earlier steps
  (at least three of them);
- ``zero reward``: every trajectory of :data:`~saorl.runtime.run_signals.COLLAPSE_MIN_STEPS`
  steps in a row rewarded exactly 0 — after a rewarded step that is the collapse the summary
  counts (:func:`~saorl.runtime.run_signals.collapse_step`), from the start a task the policy
  cannot solve yet;
- ``held-out episodes cut short``: an evaluation's ``eval/truncated_frac`` (step 0's included)
  above :data:`~saorl.runtime.run_signals.CUT_SHORT_FRAC`: that share of the held-out episodes
  ended at a limit (``rollout.max_total_tokens``, ``rollout.max_new_tokens``, the env's turns),
  not by the env, so the budget, not the policy, decided their score (a training batch's
  ``rollout/truncated_frac`` is too noisy for an alarm: a handful of episodes a step);
- ``critic not learning``: ``critic/explained_var`` ≤ 0 for
  :data:`~saorl.runtime.run_signals.CRITIC_BAD_STEPS` steps in a row (steps whose returns have no
  variance, explained variance 0 by definition, neither count nor break the stretch).

Each fires once per episode of trouble: it is re-armed only after
:data:`~saorl.runtime.run_signals.WINDOW` healthy steps in a row (the zero-reward and critic
alarms: after one), so a run that stays broken prints one line, not one a step. Pure: rows in,
alarms out; the run prints them and appends them to ``RUN/alarms.jsonl``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from saorl.runtime.run_signals import (
    COLLAPSE_MIN_STEPS,
    CRITIC_BAD_STEPS,
    CUT_SHORT_FRAC,
    DIS_KEPT_MIN,
    DRIFT_KL,
    LENGTH_COLLAPSE_FRAC,
    WINDOW,
)


@dataclass(frozen=True)
class Alarm:
    kind: str
    """``drift burst``, ``action-length collapse``, ``zero reward``, ``critic not learning``,
    or ``held-out episodes cut short``."""
    step: int
    key: str
    """The metric that raised it, and its value at ``step``."""
    value: float
    text: str
    """The console line (``alarm at step N: ...``)."""

    def row(self) -> dict:
        return {"step": self.step, "alarm": self.kind, "key": self.key, "value": self.value,
                "text": self.text}


def _num(row: Mapping, key: str) -> float | None:
    v = row.get(key)
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


@dataclass
class _Detector:
    """One kind of trouble: ``check(row)`` is (bad, key, value, what) or None (no data this step)."""

    kind: str
    check: Callable[[Mapping], tuple[bool, str, float, str] | None]
    rearm_after: int
    at_start: bool = False
    """Checked on the step-0 row (the evaluation before training) too."""
    firing: bool = False
    healthy: int = 0

    def observe(self, step: int, row: Mapping) -> Alarm | None:
        got = self.check(row)
        if got is None:
            return None
        bad, key, value, what = got
        if not bad:
            self.healthy += 1
            if self.healthy >= self.rearm_after:
                self.firing = False
            return None
        self.healthy = 0
        if self.firing:
            return None
        self.firing = True
        return Alarm(self.kind, step, key, value, f"alarm at step {step}: {self.kind}: {what}")


@dataclass
class RunAlarms:
    """The live alarms of one run (module docstring); ``hint_lr`` names the learning rate in the
    drift alarm's advice."""

    hint_lr: str = "trainer.policy_lr"
    _lengths: list[float] = field(default_factory=list)
    _zero: int = 0
    _rewarded: bool = False
    _critic_bad: int = 0

    def __post_init__(self) -> None:
        self._detectors = [
            _Detector("drift burst", self._drift, WINDOW),
            _Detector("action-length collapse", self._length, WINDOW),
            _Detector("zero reward", self._zero_reward, 1),
            _Detector("critic not learning", self._critic, 1),
            _Detector("held-out episodes cut short", _cut_short, 1, at_start=True),
        ]

    def observe(self, row: Mapping) -> list[Alarm]:
        """The alarms that start at this metrics row (a trainer step's; of a step-0 row, the
        evaluation before training, only the held-out checks)."""
        step = int(row.get("step", 0))
        if step < 0:
            return []
        return [a for d in self._detectors
                if (step > 0 or d.at_start) and (a := d.observe(step, row)) is not None]

    # ------------------------------------------------------------------ the checks
    def _drift(self, row: Mapping) -> tuple[bool, str, float, str] | None:
        kl, kept = _num(row, "mismatch/kl"), _num(row, "policy/dis_kept_frac")
        if kl is None and kept is None:
            return None
        advice = f"the policy moved far from the one that sampled; is {self.hint_lr} too large?"
        if kl is not None and kl > DRIFT_KL:
            return True, "mismatch/kl", kl, f"mismatch/kl {kl:.4g} > {DRIFT_KL:g} ({advice})"
        if kept is not None and kept < DIS_KEPT_MIN:
            return (True, "policy/dis_kept_frac", kept,
                    f"policy/dis_kept_frac {kept:.3f} < {DIS_KEPT_MIN:g}: most tokens masked out ({advice})")
        return False, "", 0.0, ""

    def _length(self, row: Mapping) -> tuple[bool, str, float, str] | None:
        mean = _num(row, "rollout/action_tokens_mean")
        if mean is None:
            return None
        before = statistics.median(self._lengths) if len(self._lengths) >= 3 else None
        self._lengths.append(mean)
        if before is None:
            return None
        bad = mean < LENGTH_COLLAPSE_FRAC * before
        return (bad, "rollout/action_tokens_mean", mean,
                f"rollout/action_tokens_mean {mean:.1f} < {LENGTH_COLLAPSE_FRAC:g} × {before:.1f} "
                "(the median "
                "of the steps before): the policy learned to stop early")

    def _zero_reward(self, row: Mapping) -> tuple[bool, str, float, str] | None:
        mean = _num(row, "reward/mean")
        if mean is None:
            return None
        all_zero = mean == 0.0 and (_num(row, "reward/std") or 0.0) == 0.0
        self._zero = self._zero + 1 if all_zero else 0
        if not all_zero:
            self._rewarded = True
            return False, "", 0.0, ""
        if self._zero < COLLAPSE_MIN_STEPS:
            return None  # not yet long enough to tell; neither trouble nor health
        why = ("after rewarded steps: the run collapsed, nothing left to learn from" if self._rewarded
               else "since the start: the task may be too hard for this policy, or the reward broken")
        what = f"every trajectory of the last {self._zero} steps rewarded 0 ({why})"
        return True, "reward/mean", mean, what

    def _critic(self, row: Mapping) -> tuple[bool, str, float, str] | None:
        ev = _num(row, "critic/explained_var")
        if ev is None or ev == 0.0:  # no critic, or returns without variance: 0 by definition
            return None
        self._critic_bad = self._critic_bad + 1 if ev < 0 else 0
        if ev > 0:
            return False, "", 0.0, ""
        if self._critic_bad < CRITIC_BAD_STEPS:
            return None
        return (True, "critic/explained_var", ev,
                f"critic/explained_var ≤ 0 for {self._critic_bad} steps in a row (now {ev:.3f}): the value "
                "model predicts returns no better than their mean; check trainer.critic_lr")


def _cut_short(row: Mapping) -> tuple[bool, str, float, str] | None:
    frac = _num(row, "eval/truncated_frac")
    if frac is None:
        return None
    return (frac > CUT_SHORT_FRAC, "eval/truncated_frac", frac,
            f"eval/truncated_frac {frac:.2f} > {CUT_SHORT_FRAC:g}: {frac:.0%} of the held-out episodes "
            "ended at a limit (rollout.max_total_tokens, rollout.max_new_tokens or the env's turns), not "
            "by the env, so the budget decided their score; raise the limit, or look at the samples "
            "for replies that ramble or repeat")
