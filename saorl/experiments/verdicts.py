"""The report's verdicts: outcomes at equal trainer steps *and* at equal wall clock, under one rule.

Arms that sample synchronously (GRPO's groups) and asynchronously (SAO) do different amounts of
work per trainer step, so :func:`verdict_section` compares them both ways, each outcome paired by
seed against the reference arm (:func:`saorl.experiments.stats.paired_interval`):

- ``acc@S``: test accuracy at the last evaluation at or before trainer step S, S the fewest steps
  any run took (:func:`saorl.runtime.run_signals.accuracy_at`);
- ``acc@M`` (``acc@5min``): test accuracy of the policy the run had M into its RL loop
  (:func:`accuracy_at_wall`): the last evaluation of a step reached by then (``time/elapsed_s``
  of that step, evaluations included in the clock). A run that finished its steps before M counts
  with its final policy, the one it had at M;
- ``reward AUC``: the mean training reward over the first S steps.

**The rule** (docs/results.md): a verdict needs at least :data:`MIN_SEEDS` paired seeds and an
interval that excludes 0 (``arm ahead`` / ``reference ahead``); an interval that spans 0 is
``not resolved ±w`` (its half width: the size of a difference it could have seen); fewer seeds
give no verdict at all (:func:`verdict`).

:func:`arm_section` adds, per arm: the mean staleness (``rollout/staleness_mean`` over a run's
steps, then over seeds), the collapses (:func:`saorl.runtime.run_signals.collapse_step`) as a
count, and the share of rewarded-but-wrong replies (an env's ``rewarded_wrong`` metric, e.g.
``reasoning_gym``'s: rewarded, not a success) pooled over all seeds: in training (every step's
batch mean, batches of equal size) and in the final held-out evaluation (weighted by its episodes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from saorl.experiments.stats import Interval, mean_interval, paired_interval
from saorl.runtime.run_signals import accuracy_at, collapse_step, reward_auc

MIN_SEEDS = 5
"""Paired seeds a verdict needs (docs/results.md's rule)."""
GAMED_TRAIN = "env/rewarded_wrong"
GAMED_EVAL = "eval/env/rewarded_wrong"


def verdict(iv: Interval | None, min_seeds: int = MIN_SEEDS) -> str:
    """``arm ahead`` / ``reference ahead`` (the interval excludes 0, with enough seeds),
    ``not resolved ±w``, or ``no verdict (n seeds < 5)``."""
    if iv is None:
        return "–"
    if iv.n < min_seeds or iv.half_width is None:
        return f"no verdict ({iv.n} seed{'s' if iv.n != 1 else ''} < {min_seeds})"
    if iv.excludes_zero():
        return "arm ahead" if iv.mean > 0 else "reference ahead"
    return f"not resolved ±{iv.half_width:.3f}"


def accuracy_at_wall(evals: Sequence[dict], seconds: float) -> float | None:
    """``eval/accuracy`` of the last evaluation whose step was reached within ``seconds`` of the
    RL loop (each eval row's ``wall_s``: its step's ``time/elapsed_s``, 0 at step 0)."""
    got = [(float(r["wall_s"]), int(r.get("step", 0)), float(r["eval/accuracy"])) for r in evals
           if r.get("eval/accuracy") is not None and r.get("wall_s") is not None
           and float(r["wall_s"]) <= seconds]
    return max(got)[2] if got else None


def _minutes(seconds: float) -> str:
    """A wall-clock mark as a column name: ``5min``, or ``90s`` where it is not whole minutes."""
    return f"{seconds / 60:g}min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g}s"


def outcomes(run, steps: int, marks: Sequence[float]) -> dict[str, float | None]:
    """One run's outcomes: ``acc@S``, ``acc@M`` per mark, ``reward AUC`` over the first S steps."""
    rows = [r for r in run.metrics if 0 < r.get("step", 0) <= steps]
    out = {f"acc@{steps}": accuracy_at(run.evals, steps)}
    out |= {f"acc@{_minutes(m)}": accuracy_at_wall(run.evals, m) for m in marks}
    out["reward AUC"] = reward_auc(rows)
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def verdict_section(trained: Sequence, ref: str, marks: Sequence[float] = ()) -> list[str]:
    """The report's "Verdicts" section: one row per (outcome, arm other than ``ref``)."""
    steps = min((int(r.metrics[-1]["step"]) for a in trained for r in a.runs if r.metrics), default=0)
    if steps <= 0:
        return []
    per_arm = {a.name: {r.seed: outcomes(r, steps, marks) for r in a.runs} for a in trained}
    base = per_arm.get(ref, {})
    names = [f"acc@{steps}", *(f"acc@{_minutes(m)}" for m in marks), "reward AUC"]
    rows = []
    for name in names:
        for arm, seeds in per_arm.items():
            if arm == ref:
                continue
            mine = mean_interval([v[name] for v in seeds.values()])
            diff = paired_interval({s: v[name] for s, v in seeds.items()},
                                   {s: v[name] for s, v in base.items()})
            ref_iv = mean_interval([v[name] for v in base.values()])
            rows.append([name, arm, _fmt(mine), _fmt(ref_iv), _fmt(diff, signed=True), verdict(diff)])
    reached = wall_marks_reached(trained, marks)
    total = sum(len(a.runs) for a in trained)
    marks_text = ", ".join(f"{_minutes(m)} ({reached[m]}/{total} runs still training)"
                           for m in marks) or "none set"
    return [f"## Verdicts against `{ref}`, at equal trainer steps ({steps}) and at equal wall clock", "",
            _table(["outcome", "arm", "arm", ref, f"arm − {ref} (paired)", "verdict"], rows), "",
            f"acc@{steps}: test accuracy at the last evaluation at or before step {steps} (the fewest "
            f"steps any run took); acc@M (marks: {marks_text}): test accuracy of the policy each "
            "run had M into its RL loop (the last evaluation of a step reached by then, "
            "evaluations counted in the clock; a run that finished its steps earlier counts with its "
            f"final policy); reward AUC: the mean training reward over the first {steps} steps. Cells: "
            f"mean [95% t-interval]. Verdict (docs/results.md's rule): with ≥ {MIN_SEEDS} paired seeds, "
            "`arm ahead` / `reference ahead` where the paired interval excludes 0, else `not resolved "
            "±half width`; fewer seeds: no verdict.",
            ""]


def _fmt(iv: Interval | None, signed: bool = False) -> str:
    if iv is None:
        return "–"
    return iv.fmt(3, signed) + ("*" if signed and iv.excludes_zero() else "")


def gamed_share(runs: Sequence) -> tuple[float | None, float | None, float]:
    """(training share, final held-out share, held-out replies) of rewarded-but-wrong replies,
    pooled over ``runs`` (see the module docstring); None where no run logged the metric."""
    train = [float(r[GAMED_TRAIN]) for run in runs for r in run.metrics
             if r.get(GAMED_TRAIN) is not None and math.isfinite(float(r[GAMED_TRAIN]))]
    finals = [next((e for e in reversed(run.evals) if e.get(GAMED_EVAL) is not None), None) for run in runs]
    pairs = [(float(e[GAMED_EVAL]), float(e.get("eval/episodes") or 0.0)) for e in finals if e is not None]
    n = sum(w for _, w in pairs)
    held = sum(v * w for v, w in pairs) / n if n else None
    return (statistics.fmean(train) if train else None), held, n


def staleness(run) -> float | None:
    key = "rollout/staleness_mean"
    vals = [float(r[key]) for r in run.metrics if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def arm_section(trained: Sequence) -> list[str]:
    """The report's "Per arm" section: staleness, collapses, rewarded-but-wrong shares."""
    if not trained:
        return []
    rows, gamed = [], False
    for arm in trained:
        collapsed = [collapse_step(r.metrics) is not None for r in arm.runs
                     if any(m.get("reward/mean") is not None for m in r.metrics)]
        train, held, n = gamed_share(arm.runs)
        gamed |= train is not None or held is not None
        rows.append([arm.name, str(len(arm.runs)), _fmt(mean_interval([staleness(r) for r in arm.runs])),
                     f"{sum(collapsed)}/{len(collapsed)}" if collapsed else "–",
                     "–" if train is None else f"{train:.3f}",
                     "–" if held is None else f"{held:.3f} (of {n:.0f})"])
    note = ("rewarded but wrong: the share of replies the env rewarded (score > 0) that were not a "
            "success (its `rewarded_wrong` metric), pooled over every seed: in training over all steps "
            "(equal batches), held-out at each run's final evaluation (of N replies)."
            if gamed else "rewarded but wrong: this env reports no `rewarded_wrong` metric.")
    return ["## Per arm: staleness, collapses, reward gaming", "",
            _table(["arm", "seeds", "staleness (versions)", "collapsed", "rewarded but wrong (train)",
                    "rewarded but wrong (held-out, final)"], rows), "",
            "staleness: `rollout/staleness_mean` over a run's steps, mean [95% t-interval] over seeds; "
            "collapsed: runs that ended with a zero training reward for their last 20 steps or more after a "
            f"rewarded one (docs/results.md: a count, not a verdict); {note}", ""]


def wall_marks_reached(trained: Sequence, marks: Sequence[float]) -> Mapping[float, int]:
    """Per mark, how many runs were still training at it (the others count with their final policy)."""
    ends = [next((float(r["wall_s"]) for r in reversed(run.metrics) if r.get("wall_s") is not None), 0.0)
            for a in trained for run in a.runs]
    return {m: sum(e > m for e in ends) for m in marks}
