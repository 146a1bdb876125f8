"""Inputs of the pipeline simulator: cluster shape, decode-step curve, length distribution, trainer cost.

Everything here is plain data plus the loaders that turn measurements into it:

- :class:`DecodeCurve` — seconds per decode step of one engine as a function of the number of
  trajectories decoding in it (``b``): modelled ``t0 + t1·b``, or measured ``(b, seconds)`` points
  joined piecewise-linearly (linear extrapolation past the last point, from the last two).
- :class:`LengthDist` — response length in tokens of one trajectory: ``constant``, ``lognormal``
  (mean and coefficient of variation; σ² = ln(1 + cv²), μ = ln(mean) − σ²/2) or ``empirical``
  (a list, drawn with replacement, or in order when ``cycle`` is set — for hand-checkable tests).
  Every draw is rounded and clipped to ``[1, max_len]``: engines stop at a token budget.
- :func:`load_lengths` — lengths from a saorl run: ``samples/samples.jsonl`` (one trajectory per
  line; length = number of ones in ``action_mask``) is preferred; ``metrics.jsonl`` only has the
  per-batch mean ``rollout/action_tokens_mean``, which hides the tail, so it is the fallback. A
  plain JSON list or whitespace/comma-separated text also works.
- :func:`load_decode_curve` — a JSON file ``[[b, s], ...]``, ``{"points": [[b, s], ...]}`` or
  ``{"batch": [...], "seconds": [...]}``.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from saorl.run_paths import RunPaths


class SimInputError(ValueError):
    """A simulator parameter or input file is invalid; the message names what is wrong."""


@dataclass(frozen=True)
class DecodeCurve:
    """Seconds per decode step of one engine with ``b`` trajectories decoding (``b ≥ 1``).

    ``points`` are ``(batch, seconds)`` pairs sorted by batch; two points make the linear model.
    """

    points: tuple[tuple[float, float], ...]

    @classmethod
    def linear(cls, t0: float, t1: float) -> DecodeCurve:
        if t0 < 0 or t1 < 0 or t0 + t1 <= 0:
            raise SimInputError(f"decode curve t0={t0}, t1={t1}: need t0, t1 ≥ 0 and t0 + t1 > 0")
        return cls(((0.0, float(t0)), (1.0, float(t0 + t1))))

    @classmethod
    def measured(cls, points) -> DecodeCurve:
        pts = sorted((float(b), float(s)) for b, s in points)
        if not pts:
            raise SimInputError("decode curve: no (batch, seconds) points")
        if any(s <= 0 or b < 0 for b, s in pts):
            raise SimInputError(f"decode curve: batch must be ≥ 0 and seconds > 0, got {pts}")
        if len({b for b, _ in pts}) != len(pts):
            raise SimInputError(f"decode curve: repeated batch sizes in {pts}")
        return cls(tuple(pts))

    def __call__(self, b: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        xs = [p[0] for p in pts]
        i = int(np.clip(np.searchsorted(xs, b) - 1, 0, len(pts) - 2))
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
        y = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
        return max(y, 1e-9)

    def table(self, slots: int) -> list[float]:
        """``table[b]`` = step seconds with ``b`` decoding, for ``b = 0..slots`` (``table[0]`` unused)."""
        return [0.0] + [self(b) for b in range(1, slots + 1)]


@dataclass(frozen=True)
class LengthDist:
    """Response length (action tokens) of one trajectory.

    kind: ``constant`` (``mean``), ``lognormal`` (``mean``, ``cv``) or ``empirical`` (``values``).
    """

    kind: str = "lognormal"
    mean: float = 2000.0
    cv: float = 1.0
    values: tuple[int, ...] = ()
    cycle: bool = False
    max_len: int = 16384

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "lognormal", "empirical"):
            raise SimInputError(f"length distribution kind {self.kind!r}: "
                                "use constant, lognormal or empirical")
        if self.max_len < 1:
            raise SimInputError(f"max_len {self.max_len} must be ≥ 1")
        if self.kind == "empirical":
            if not self.values:
                raise SimInputError("empirical length distribution has no values")
            if min(self.values) < 1:
                raise SimInputError(f"empirical lengths must be ≥ 1 token, got min {min(self.values)}")
        elif self.mean < 1:
            raise SimInputError(f"mean length {self.mean} must be ≥ 1 token")
        if self.kind == "lognormal" and self.cv < 0:
            raise SimInputError(f"length cv {self.cv} must be ≥ 0")

    @classmethod
    def parse(cls, spec: str, max_len: int = 16384) -> LengthDist:
        """``lognormal:MEAN:CV`` or ``constant:LEN``."""
        parts = spec.split(":")
        try:
            if parts[0] == "lognormal" and len(parts) == 3:
                return cls("lognormal", float(parts[1]), float(parts[2]), max_len=max_len)
            if parts[0] == "constant" and len(parts) == 2:
                return cls("constant", float(parts[1]), max_len=max_len)
        except ValueError as e:
            raise SimInputError(f"length spec {spec!r}: {e}") from None
        raise SimInputError(f"length spec {spec!r}: use lognormal:MEAN:CV or constant:LEN")

    def sampler(self, rng: np.random.Generator):
        """A function ``draw() -> int``; lognormal/empirical draws come in blocks for speed."""
        cap = self.max_len
        if self.kind == "constant":
            n = int(min(cap, max(1, round(self.mean))))
            return lambda: n
        if self.kind == "empirical" and self.cycle:
            vals = [int(min(cap, v)) for v in self.values]
            state = {"i": -1}

            def nxt() -> int:
                state["i"] = (state["i"] + 1) % len(vals)
                return vals[state["i"]]

            return nxt
        return _BlockSampler(self, rng).draw

    def describe(self) -> str:
        if self.kind == "constant":
            return f"constant {self.mean:g}"
        if self.kind == "lognormal":
            return f"lognormal mean {self.mean:g} cv {self.cv:g} (cap {self.max_len})"
        v = np.asarray(self.values, dtype=float)
        return f"empirical n={len(v)} mean {v.mean():.0f} cv {v.std() / v.mean():.2f}"


class _BlockSampler:
    def __init__(self, dist: LengthDist, rng: np.random.Generator, block: int = 4096) -> None:
        self.dist, self.rng, self.block = dist, rng, block
        self.buf: list[int] = []

    def draw(self) -> int:
        if not self.buf:
            d = self.dist
            if d.kind == "lognormal":
                s2 = math.log1p(d.cv**2)
                x = self.rng.lognormal(math.log(d.mean) - s2 / 2, math.sqrt(s2), self.block)
            else:
                x = self.rng.choice(np.asarray(d.values, dtype=float), self.block)
            self.buf = np.clip(np.rint(x), 1, d.max_len).astype(int)[::-1].tolist()
        return self.buf.pop()


@dataclass(frozen=True)
class SimParams:
    """One cluster shape and workload. Times in seconds, lengths in tokens."""

    engines: int = 8
    """Rollout engines (one GPU each, or one tensor-parallel group)."""
    slots: int = 64
    """Decode slots per engine (the engine's max batch)."""
    decode: DecodeCurve = field(default_factory=lambda: DecodeCurve.linear(0.015, 0.0002))
    """Seconds per decode step vs trajectories decoding in the engine."""
    lengths: LengthDist = field(default_factory=LengthDist)
    """Response length per trajectory (all turns together)."""
    turns: int = 1
    """Turns per trajectory; the length is split evenly over them."""
    env_latency_s: float = 0.0
    """Environment time between two turns (the trajectory holds its slot but does not decode)."""
    train_a: float = 5.0
    """Fixed seconds per training step (optimizer, critic steps' overhead, gathering)."""
    train_b: float = 3e-5
    """Training seconds per action token in the batch."""
    publish_s: float = 2.0
    """Weight publication: seconds from the end of a step to new weights being usable; the
    trainer is blocked meanwhile (as in ``Run.loop``)."""
    group_size: int = 1
    group_lengths: str = "independent"
    """``independent``: every trajectory draws its own length; ``shared``: the members of a
    group (one prompt) all get their group's length — when the task fixes the length, as in the
    synthetic benchmark env (real tasks lie in between: lengths correlate within a group)."""
    batch_size: int = 512
    """Trajectories per training step (a multiple of ``group_size``)."""
    max_staleness: int | None = None
    """Async only: groups with a member staler than this are dropped (and counted)."""
    shared_resources: bool = False
    """Engines and trainer share the same chips (co-located, e.g. one CPU)."""
    contention: float = 2.0
    """With ``shared_resources``: decode steps take ×contention while the trainer trains, and
    training runs ×contention slower while any engine decodes."""

    def __post_init__(self) -> None:
        for name in ("engines", "slots", "turns", "group_size", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise SimInputError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.group_lengths not in ("independent", "shared"):
            raise SimInputError(f"group_lengths must be 'independent' or 'shared', "
                                f"got {self.group_lengths!r}")
        if self.batch_size % self.group_size:
            raise SimInputError(f"batch_size {self.batch_size} must be a multiple of "
                                f"group_size {self.group_size}")
        for name in ("env_latency_s", "train_a", "train_b", "publish_s"):
            if getattr(self, name) < 0:
                raise SimInputError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise SimInputError(f"max_staleness must be ≥ 0 or None, got {self.max_staleness}")
        if self.contention < 1:
            raise SimInputError(f"contention {self.contention} must be ≥ 1 (a slowdown factor)")

    def train_time(self, tokens: int) -> float:
        return self.train_a + self.train_b * tokens

    def scaled(self, engines: int, base_engines: int | None = None) -> SimParams:
        """The same workload on ``engines`` engines: batch ∝ engines (rounded to whole groups, at
        least one), trainer seconds per token ∝ 1/engines (a data-parallel trainer whose GPU count
        grows with the engines; its fixed cost ``train_a`` and ``publish_s`` do not shrink)."""
        base = base_engines or self.engines
        k = engines / base
        groups = max(1, round(self.batch_size * k / self.group_size))
        return replace(self, engines=engines, batch_size=groups * self.group_size, train_b=self.train_b / k)


# ------------------------------------------------------------------------------------ loaders
def _numbers(text: str, source: str) -> list[float]:
    toks = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    try:
        return [float(t) for t in toks]
    except ValueError as e:
        raise SimInputError(f"{source}: not a list of numbers ({e})") from None


def _lengths_from_jsonl(path: Path) -> list[int]:
    from_masks, from_means = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SimInputError(f"{path}:{n}: bad JSON ({e})") from None
        if isinstance(row, dict) and "action_mask" in row:
            from_masks.append(int(sum(1 for m in row["action_mask"] if m)))
        elif isinstance(row, dict) and "rollout/action_tokens_mean" in row:
            from_means.append(round(float(row["rollout/action_tokens_mean"])))
    if from_masks:
        return from_masks
    if from_means:
        warnings.warn(f"{path}: only per-batch mean lengths (rollout/action_tokens_mean); the "
                      "length tail is lost — prefer samples/samples.jsonl", stacklevel=3)
        return from_means
    raise SimInputError(f"{path}: no line has 'action_mask' or 'rollout/action_tokens_mean'")


def load_lengths(path: str | Path) -> list[int]:
    """Response lengths (tokens) from a run directory, a ``.jsonl``, a JSON list or a text list."""
    p = Path(path)
    if p.is_dir():
        run = RunPaths(p)
        for cand in (run.samples / "samples.jsonl", p / "samples.jsonl", run.metrics):
            if cand.is_file():
                return load_lengths(cand)
        raise SimInputError(f"{p}: no samples/samples.jsonl or metrics.jsonl in this directory")
    if not p.is_file():
        raise SimInputError(f"lengths file {p} does not exist")
    if p.suffix == ".jsonl":
        out = _lengths_from_jsonl(p)
    else:
        text = p.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
            if isinstance(data, dict):
                data = data.get("lengths", data)
            if not isinstance(data, list):
                raise SimInputError(f"{p}: JSON must be a list of lengths or {{'lengths': [...]}}")
            out = [round(float(x)) for x in data]
        except json.JSONDecodeError:
            out = [round(x) for x in _numbers(text, str(p))]
    out = [x for x in out if x > 0]
    if not out:
        raise SimInputError(f"{p}: no positive lengths found")
    return out


def load_decode_curve(path: str | Path) -> DecodeCurve:
    """A measured decode curve from JSON (see the module docstring for the accepted shapes)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SimInputError(f"decode curve {p}: {e}") from None
    if isinstance(data, dict) and "points" in data:
        data = data["points"]
    elif isinstance(data, dict) and "batch" in data and "seconds" in data:
        if len(data["batch"]) != len(data["seconds"]):
            raise SimInputError(f"decode curve {p}: 'batch' and 'seconds' differ in length")
        data = list(zip(data["batch"], data["seconds"]))
    if not isinstance(data, list) or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in data):
        raise SimInputError(f"decode curve {p}: expected [[batch, seconds], ...], "
                            "{'points': [...]} or {'batch': [...], 'seconds': [...]}")
    return DecodeCurve.measured(data)
