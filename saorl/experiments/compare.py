"""The report's comparison tables: outcomes with confidence intervals, and the mechanisms' signals.

**Outcomes** (:func:`comparison_table`): for each outcome (final and best test accuracy, final
training reward) and each arm, the 95% t-interval of the mean over seeds, and the 95% t-interval
of the mean per-seed difference from the *reference arm* (paired by seed: every arm of one seed
starts from the same SFT model and is evaluated on the same tasks), marked ``*`` when it excludes 0.

**Signals** (:func:`signal_table`): what each arm's mechanism did, per run from its
``metrics.jsonl`` and then as a t-interval over seeds:

- staleness: ``rollout/staleness_mean`` averaged over the steps;
- mismatch: ``mismatch/kl_s0`` (KL(rollout ‖ trainer) on staleness-0 tokens: the engine/trainer
  mismatch alone; averaged over the steps weighted by their staleness-0 tokens, whose mean count
  per step is shown too: asynchronous runs have few), ``mismatch/kl`` (all tokens: mismatch plus
  drift), ``mismatch/outside_band_frac`` (tokens outside the DIS band) and
  ``mismatch/outside_band_weight_share`` (their share of the uncorrected gradient's weight
  ``|r·A|``), averaged over the steps;
- ``policy/dis_kept_frac`` (DIS arms), ``policy/clip_frac`` (PPO-clipped arms), averaged;
- entropy: ``policy/entropy`` over the first and the last 10% of the steps;
- ``critic/explained_var`` (the critic's, before its updates on the batch), averaged;
- ``adv/first_token_std`` and ``adv/return_std``, averaged: the credit reaching the first decision
  against the return spread;
- grad-norm spikes: the largest ``policy/grad_norm`` of the run over the median of its non-zero
  ones, and the share of steps with no gradient at all (every advantage 0: a group baseline whose
  group got equal rewards, or a collapsed run);
- collapse (:func:`collapse_step`): the share of seeds whose run ended collapsed, and the step
  where those collapses began.

A column is shown only when some arm logged its metric.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from saorl.experiments.stats import Interval, mean_interval, paired_interval
from saorl.runtime.run_signals import COLLAPSE_MIN_STEPS, collapse_step  # noqa: F401 (re-exported)

OUTCOMES = (("final acc", "final_acc"), ("best acc", "best_acc"), ("final reward", "final_reward"))


def _rows_md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(iv: Interval | None, digits: int = 3, signed: bool = False) -> str:
    if iv is None:
        return "–"
    return iv.fmt(digits, signed) + ("*" if signed and iv.excludes_zero() else "")


def comparison_table(per_arm: dict[str, dict[int, dict]], reference: str, level: float = 0.95) -> str:
    """``per_arm``: arm → seed → :func:`saorl.experiments.report.run_summary`. One row per arm:
    each outcome's interval, and its paired difference from ``reference`` (– for the reference)."""
    header = ["arm", "seeds"]
    for label, _ in OUTCOMES:
        header += [label, f"{label} − {reference}"]
    ref = per_arm.get(reference, {})
    rows = []
    for arm, seeds in per_arm.items():
        row = [arm, str(len(seeds))]
        for _, key in OUTCOMES:
            row.append(_fmt(mean_interval([s[key] for s in seeds.values()], level)))
            if arm == reference:
                row.append("–")
            else:
                diff = paired_interval({k: v[key] for k, v in seeds.items()},
                                       {k: v[key] for k, v in ref.items()}, level)
                row.append(_fmt(diff, signed=True))
        rows.append(row)
    return _rows_md(header, rows)


def _finite(metrics: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in metrics if r.get(key) is not None and math.isfinite(float(r[key]))]


def _mean_of(key: str) -> Callable[[list[dict]], float | None]:
    def f(metrics: list[dict]) -> float | None:
        vals = _finite(metrics, key)
        return statistics.fmean(vals) if vals else None
    return f


def _per_step(key: str) -> Callable[[list[dict]], float | None]:
    """Mean of ``key`` over every trainer step, 0 where a step did not log it (a bucket's token
    count: a step with no token in the bucket leaves it out)."""
    def f(metrics: list[dict]) -> float | None:
        steps = [r for r in metrics if r.get("step", 0) > 0]
        return statistics.fmean(float(r.get(key) or 0.0) for r in steps) if steps else None
    return f


def _window_mean(key: str, first: bool, frac: float = 0.1) -> Callable[[list[dict]], float | None]:
    def f(metrics: list[dict]) -> float | None:
        vals = _finite(metrics, key)
        if not vals:
            return None
        k = max(1, math.ceil(len(vals) * frac))
        return statistics.fmean(vals[:k] if first else vals[-k:])
    return f


def spike_ratio(metrics: list[dict], key: str = "policy/grad_norm") -> float | None:
    """The run's largest ``key`` over the median of its non-zero values (how far its worst spike
    stands out; a GRPO group whose rewards are all equal has no gradient at all, and those steps
    would make the median 0)."""
    vals = [v for v in _finite(metrics, key) if v > 0]
    if len(vals) < 2:
        return None
    return max(vals) / statistics.median(vals)


def zero_frac(metrics: list[dict], key: str = "policy/grad_norm") -> float | None:
    """The share of steps whose ``key`` is exactly 0 (no gradient: every advantage was 0)."""
    vals = _finite(metrics, key)
    return sum(v == 0 for v in vals) / len(vals) if vals else None


def _collapsed(metrics: list[dict]) -> float | None:
    if not any(r.get("reward/mean") is not None for r in metrics):
        return None
    return 1.0 if collapse_step(metrics) is not None else 0.0


def token_weighted(key: str, tokens: str) -> Callable[[list[dict]], float | None]:
    """Mean of ``key`` over the steps weighted by ``tokens`` (a per-bucket statistic whose bucket
    holds a handful of tokens in some steps and hundreds in others)."""
    def f(metrics: list[dict]) -> float | None:
        pairs = [(float(r[key]), float(r[tokens])) for r in metrics
                 if r.get(key) is not None and r.get(tokens) and math.isfinite(float(r[key]))]
        n = sum(t for _, t in pairs)
        return sum(v * t for v, t in pairs) / n if n else None
    return f


SIGNALS: tuple[tuple[str, Callable[[list[dict]], float | None], int], ...] = (
    ("staleness", _mean_of("rollout/staleness_mean"), 1),
    ("KL s0", token_weighted("mismatch/kl_s0", "mismatch/tokens_s0"), 4),
    ("s0 tokens/step", _per_step("mismatch/tokens_s0"), 1),
    ("KL all", _mean_of("mismatch/kl"), 4),
    ("outside band", _mean_of("mismatch/outside_band_frac"), 4),
    ("outside-band weight", _mean_of("mismatch/outside_band_weight_share"), 3),
    ("DIS kept", _mean_of("policy/dis_kept_frac"), 4),
    ("clip frac", _mean_of("policy/clip_frac"), 4),
    ("entropy first 10%", _window_mean("policy/entropy", True), 3),
    ("entropy last 10%", _window_mean("policy/entropy", False), 3),
    ("critic EV", _mean_of("critic/explained_var"), 2),
    ("first-token adv sd", _mean_of("adv/first_token_std"), 3),
    ("return sd", _mean_of("adv/return_std"), 3),
    ("grad-norm max/median", spike_ratio, 1),
    ("zero-grad steps", zero_frac, 3),
    ("collapsed", _collapsed, 2),
    ("collapse step", collapse_step, 0),
)
"""(column, per-run value from the run's metrics rows, digits)."""


def signal_values(metrics: list[dict]) -> dict[str, float | None]:
    """Every :data:`SIGNALS` column for one run."""
    return {name: fn(metrics) for name, fn, _ in SIGNALS}


def signal_table(per_arm: dict[str, list[list[dict]]], level: float = 0.95) -> str:
    """``per_arm``: arm → its runs' metrics rows. One row per arm; a column per signal some arm has."""
    values = {arm: [signal_values(m) for m in runs] for arm, runs in per_arm.items()}
    shown = [(name, digits) for name, _, digits in SIGNALS
             if any(v[name] is not None for runs in values.values() for v in runs)]
    rows = []
    for arm, runs in values.items():
        rows.append([arm, str(len(runs))] + [_fmt(mean_interval([v[name] for v in runs], level), digits)
                                             for name, digits in shown])
    return _rows_md(["arm", "seeds", *(n for n, _ in shown)], rows)
