"""Confidence intervals for an experiment's comparisons: Student-t intervals over seeds.

Every comparison in a report is over seeds: each seed gives one number per arm (its final
accuracy, say), and

- :func:`mean_interval` is the two-sided ``level`` t-interval of the mean of those per-seed
  numbers: ``mean ± t_{(1+level)/2, n−1} · sd / √n`` (``sd`` with n − 1 in the denominator);
- :func:`paired_interval` is the same interval for the per-seed differences ``arm − reference``
  over the seeds both arms ran. Every arm of a seed starts from the same SFT model and is
  evaluated on the same tasks, so pairing by seed removes the shared part of the noise.

With n = 1 there is no interval (``half_width`` None). The t quantile is computed here (the
regularised incomplete beta function by its continued fraction, inverted by bisection), so the
report needs no statistics package.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    mean: float
    half_width: float | None
    """``t · sd / √n``; None with fewer than two values."""
    n: int

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def excludes_zero(self) -> bool:
        return self.half_width is not None and (self.low > 0 or self.high < 0)

    def fmt(self, digits: int = 3, signed: bool = False) -> str:
        """``0.512 [0.471, 0.553]`` (``+0.012 [...]`` with ``signed``); one value: ``0.512 (n=1)``."""
        f = f"{{:{'+' if signed else ''}.{digits}f}}"
        if self.half_width is None:
            return f"{f.format(self.mean)} (n={self.n})"
        return f"{f.format(self.mean)} [{f.format(self.low)}, {f.format(self.high)}]"


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval | None:
    """The t-interval of the mean of ``values`` (NaNs and Nones dropped); None without values."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return Interval(mean, None, 1)
    t = t_quantile(0.5 + level / 2.0, len(vals) - 1)
    return Interval(mean, t * statistics.stdev(vals) / math.sqrt(len(vals)), len(vals))


def paired_interval(arm: Mapping[int, float | None], reference: Mapping[int, float | None],
                    level: float = 0.95) -> Interval | None:
    """The t-interval of the mean per-seed difference ``arm[s] − reference[s]`` over the seeds
    where both have a value; None if there is no such seed."""
    diffs = [arm[s] - reference[s] for s in sorted(arm) if s in reference
             and arm[s] is not None and reference[s] is not None
             and not math.isnan(arm[s]) and not math.isnan(reference[s])]
    return mean_interval(diffs, level)
