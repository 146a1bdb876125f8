"""How fast each stage ran *inside* a benchmark run, relative to the same stage measured alone.

On a machine where the trainer and the rollout worker share cores (this 2-core laptop), a stage
runs slower in a run than alone: the other stage takes cache, memory bandwidth and the trainer
process's interpreter lock (its feeder thread receives and journals rollouts while it trains).
The slowdowns are not one symmetric factor, and they move with the machine's load from minute
to minute, so the simulator's prediction from stage timings taken alone can be far off (see
``docs/performance.md``). These functions read a run's own logs and return, per stage, the
factor by which it ran slower than the isolated model predicts:

- **trainer**: ``train_scale = Σ busy_i / Σ (a + b·n_i + publish_s)`` over the run's steps (the
  first, which warms up, left out), where ``busy_i`` is the time between two steps' ends minus
  the time the trainer waited for data (step, publication, logging) and ``n_i`` the step's action
  tokens; ``a, b, publish_s`` the isolated fit.
- **engine**: ``decode_scale = Σ D_j / Σ L_j·step(b̄_j)`` over finished rollouts, where ``D_j`` is
  the time rollout ``j`` spent decoding (its life, less its share of queueing when more rollouts
  are in flight than there are slots — rollouts the run's end cut off count as in flight from
  their dispatch: :func:`decoding_share`), ``L_j`` its action tokens and
  ``b̄_j`` the mean decode batch meanwhile; ``step(b)`` the isolated decode step time at batch
  ``b`` with prefill folded in (``prefill_scale``). Environment time between turns counts as
  engine time here (the synthetic benchmark env answers at once).

The simulator fed the isolated costs times these factors (:func:`saorl.bench.simcheck.sim_params`
with ``in_situ=True``) no longer needs a contention model: what it still predicts is how the
stages compose — barrier waits, the long tail, slot refills, queueing and staleness.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from saorl.data.jsonl import read_jsonl
from saorl.run_paths import RunPaths
from saorl.sim import DecodeCurve


def step_busy(run_dir: Path) -> list[tuple[int, float]]:
    """``(action tokens, busy seconds)`` per trainer step after the first, from the run's logs."""
    paths = RunPaths(run_dir)
    tokens = {row["step"]: sum(row["action_tokens"]) for row in read_jsonl(paths.trained)}
    rows = [m for m in read_jsonl(paths.metrics) if "time/elapsed_s" in m and "time/wait_s" in m]
    rows.sort(key=lambda m: m["step"])
    out = []
    for prev, cur in itertools.pairwise(rows):
        if cur["step"] != prev["step"] + 1 or cur["step"] not in tokens:
            continue
        busy = cur["time/elapsed_s"] - prev["time/elapsed_s"] - cur["time/wait_s"]
        out.append((tokens[cur["step"]], max(0.0, busy)))
    return out


def train_scale(run_dir: Path, a: float, b: float, publish_s: float) -> float:
    """In-run trainer time over the isolated model ``a + b·n + publish_s`` (see the module doc)."""
    steps = step_busy(run_dir)
    if not steps:
        raise ValueError(f"{run_dir}: fewer than two consecutive trainer steps in metrics.jsonl")
    model = sum(a + b * n + publish_s for n, _ in steps)
    return sum(busy for _, busy in steps) / model


def decoding_share(intervals: list[tuple[float, float]], slots: int,
                   also_in_flight: list[tuple[float, float]] = ()) -> list[tuple[float, float]]:
    """For each rollout ``(start, end)``: its decoding seconds and the mean decode batch meanwhile.

    With ``n(t)`` rollouts in flight and ``slots`` decode slots, each in-flight rollout decodes a
    share ``min(1, slots / n)`` of the time (a worker holding more episodes than slots queues the
    rest) and the decode batch is ``min(n, slots)``. Returns ``(∫ share dt, ∫ batch·share dt /
    ∫ share dt)`` over each interval (the batch is time-weighted; 1.0 for an interval of zero
    length) — exact for the step function ``n(t)`` (a sweep over all starts and ends gives the
    cumulative integrals; an interval counts itself). ``also_in_flight``: intervals that occupy
    slots or queue places (rollouts still running when the run ended) without being returned.
    """
    if not intervals:
        return []
    if any(e < s for s, e in [*intervals, *also_in_flight]):
        raise ValueError("an interval ends before it starts (a wall-clock step?)")
    everything = [*intervals, *also_in_flight]
    times = np.array([t for iv in everything for t in iv], dtype=float)
    delta = np.array([d for _ in everything for d in (1, -1)], dtype=float)
    # at one instant, starts sort before ends; the order of events at one time stamp changes no
    # integral (the segment between them has zero width), it only keeps n(t) ≥ 0 throughout
    order = np.lexsort((-delta, times))
    times, delta = times[order], delta[order]
    n = np.cumsum(delta)  # in flight just after each event
    share = np.where(n > 0, np.minimum(1.0, slots / np.maximum(n, 1.0)), 0.0)
    batch_share = np.minimum(n, slots) * share
    dt = np.diff(times)
    cum_share = np.concatenate([[0.0], np.cumsum(share[:-1] * dt)])
    cum_batch = np.concatenate([[0.0], np.cumsum(batch_share[:-1] * dt)])

    def at(cum: np.ndarray, rate: np.ndarray, t: float) -> float:
        i = int(np.searchsorted(times, t, side="right")) - 1
        return float(cum[i] + rate[i] * (t - times[i])) if i >= 0 else 0.0

    out = []
    for s, e in intervals:
        dec = at(cum_share, share, e) - at(cum_share, share, s)
        bat = at(cum_batch, batch_share, e) - at(cum_batch, batch_share, s)
        out.append((dec, bat / dec if dec > 0 else 1.0))
    return out


def decode_scale(run_dir: Path, curve: DecodeCurve, prefill_scale: float, slots: int) -> float:
    """In-run decoding time of the rollouts over the isolated decode model (see the module doc)."""
    rows = read_jsonl(run_dir / "rollouts.jsonl")
    done = [r for r in rows if not r.get("unfinished") and r.get("t_start") is not None
            and r.get("t_end") is not None and r["t_end"] > r["t_start"] and r.get("tokens")]
    if not done:
        raise ValueError(f"{run_dir}: no finished rollout in rollouts.jsonl")
    end = max(r["t_end"] for r in done)
    # rollouts cut off by the end of the run held slots and queue places too
    cut = [(r["t_submit"], end) for r in rows if r.get("unfinished") and r.get("t_submit") is not None
           and r["t_submit"] < end]
    shares = decoding_share([(r["t_start"], r["t_end"]) for r in done], slots, cut)
    measured = sum(dec for dec, _ in shares)
    model = sum(r["tokens"] * curve(max(1.0, b)) * prefill_scale
                for r, (_, b) in zip(done, shares, strict=True))
    return measured / model


def in_situ(run_dir: Path, fit: tuple[float, float], publish_s: float, curve: DecodeCurve,
            prefill_scale: float, slots: int) -> dict:
    """Both factors of one run: ``{"train_scale": ..., "decode_scale": ...}``."""
    return {"train_scale": train_scale(run_dir, fit[0], fit[1], publish_s),
            "decode_scale": decode_scale(run_dir, curve, prefill_scale, slots)}
