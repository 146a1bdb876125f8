"""Arms compared on their runs' continuous stability signals (:mod:`saorl.runtime.run_signals`).

A binary "collapsed" count over a handful of seeds cannot tell two arms apart (4 of 6 against 2
of 6 is Fisher's exact p = 0.57), so :func:`stability_table` compares arms on the continuous
signals of their runs, each cut to the same number of trainer steps (never equal wall clock,
where the critic shares the cores): each signal as the mean over seeds and the paired difference
from the reference arm, both with 95% t-intervals (:mod:`saorl.experiments.stats`); the collapses
as a count with its exact (Clopper–Pearson) binomial interval and Fisher's exact test against the
reference arm — a count, never a verdict by itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from saorl.experiments.stats import betainc, mean_interval, paired_interval
from saorl.runtime.run_signals import (  # noqa: F401 (re-exported for the report)
    DRIFT_KL,
    WINDOW,
    accuracy_at,
    max_window_mean,
    stability_values,
)

CONTINUOUS = ("drift bursts", "max 10-step KL", "reward AUC", "update rel")


# ------------------------------------------------------------------------------ exact tests
def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact binomial interval of a rate seen ``k`` times in ``n``."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    a = (1 - level) / 2

    def quantile(p: float, x: float, y: float) -> float:  # the Beta(x, y) p-quantile, by bisection
        lo, hi = 0.0, 1.0
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if betainc(x, y, mid) < p else (lo, mid)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else quantile(a, k, n - k + 1)
    high = 1.0 if k == n else quantile(1 - a, k + 1, n - k)
    return low, high


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of Fisher's exact test of ``k1`` of ``n1`` against ``k2`` of ``n2``: the
    probability, given the margins, of a table at most as likely as the one seen."""
    total, hits = n1 + n2, k1 + k2

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, hits - x) / math.comb(total, hits)

    seen = prob(k1)
    lo, hi = max(0, hits - n2), min(n1, hits)
    return min(1.0, sum(p for x in range(lo, hi + 1) if (p := prob(x)) <= seen * (1 + 1e-9)))


# ------------------------------------------------------------------------------------ table
def _fmt(iv, digits: int, signed: bool = False) -> str:
    if iv is None:
        return "–"
    return iv.fmt(digits, signed) + ("*" if signed and iv.excludes_zero() else "")


def stability_table(per_arm: Mapping[str, Mapping[int, Mapping[str, float | None]]], reference: str,
                    level: float = 0.95) -> str:
    """``per_arm``: arm → seed → :func:`stability_values`. A row per arm: each continuous signal's
    mean [t-interval] and its paired difference from ``reference`` (``*``: the interval excludes
    0), then ``collapsed k/n [Clopper–Pearson]`` and Fisher's p against ``reference``."""
    names = [n for n in (*CONTINUOUS, *sorted({k for seeds in per_arm.values() for v in seeds.values()
                                               for k in v if k.startswith("acc@")},
                                              key=lambda k: int(k[4:])))
             if any(v.get(n) is not None for seeds in per_arm.values() for v in seeds.values())]
    header = ["arm", "seeds"] + [c for n in names for c in (n, f"{n} − {reference}")]
    header += ["collapsed", f"Fisher p vs {reference}"]
    ref = per_arm.get(reference, {})
    ref_k = [v["collapsed"] for v in ref.values() if v.get("collapsed") is not None]
    rows = []
    for arm, seeds in per_arm.items():
        row = [arm, str(len(seeds))]
        for n in names:
            digits = 4 if "KL" in n or n == "update rel" else 3
            row.append(_fmt(mean_interval([v.get(n) for v in seeds.values()], level), digits))
            row.append("–" if arm == reference else _fmt(paired_interval(
                {s: v.get(n) for s, v in seeds.items()}, {s: v.get(n) for s, v in ref.items()}, level),
                digits, signed=True))
        got = [v["collapsed"] for v in seeds.values() if v.get("collapsed") is not None]
        if got:
            lo, hi = clopper_pearson(int(sum(got)), len(got), level)
            row.append(f"{int(sum(got))}/{len(got)} [{lo:.2f}, {hi:.2f}]")
        else:
            row.append("–")
        row.append("–" if arm == reference or not got or not ref_k else
                   f"{fisher_exact(int(sum(got)), len(got), int(sum(ref_k)), len(ref_k)):.2f}")
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
