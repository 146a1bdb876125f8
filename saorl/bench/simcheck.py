"""The simulator's prediction for a measured benchmark: ``measurement.json`` → :class:`SimParams`.

Mapping (one entry of ``measurement.json`` each):

- ``engines`` × ``slots``: the rollout workers and their engine slots;
- ``decode_curve``: measured seconds per decode step vs batch, multiplied by ``prefill_scale``
  (pure-decode tok/s ÷ generation tok/s of the workload): the simulator does not model prefill,
  and the local engine re-prefills each turn's whole context, so that cost is spread over the
  decode steps;
- ``lengths``: action tokens of every trajectory the sync runs finished (sync trains all it
  samples, so these are an unbiased sample of the workload), drawn with replacement;
- ``train_sao`` / ``train_grpo``: ``(a, b)`` of step seconds ≈ a + b·tokens for the async (SAO) and
  the sync (GRPO) trainer; ``publish_s``: weight publication plus journal appends per step;
- ``contention``: how much slower a stage runs while the other runs too (measured with both at
  once; the larger of the two slowdowns, as the simulator has one factor for both); the
  simulator's ``shared_resources`` model applies it whenever both are busy.
"""

from __future__ import annotations

import statistics

from saorl.sim import DecodeCurve, LengthDist, SimParams, simulate


def sim_params(m: dict, mode: str) -> SimParams:
    """Simulator inputs for ``mode`` (``sync``: GRPO groups; ``async``: SAO) from a measurement."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    scale = float(m.get("prefill_scale", 1.0))
    a, b = m["train_grpo"] if mode == "sync" else m["train_sao"]
    contention = float(m.get("contention", 1.0))
    return SimParams(
        engines=int(m["engines"]), slots=int(m["slots"]),
        decode=DecodeCurve.measured([(bb, s * scale) for bb, s in m["decode_curve"]]),
        lengths=LengthDist("empirical", values=tuple(int(x) for x in m["lengths"]), max_len=10**6),
        train_a=float(a), train_b=float(b), publish_s=float(m["publish_s"]),
        group_size=int(m["group_size"]) if mode == "sync" else 1, batch_size=int(m["batch_size"]),
        shared_resources=contention > 1.0, contention=max(1.0, contention))


def predict(m: dict, seeds: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    """Simulated sync and async trained tokens/s over the measured window, mean over ``seeds``."""
    d = float(m["duration_s"])
    sync = [simulate(sim_params(m, "sync"), "sync", d, s).tokens_per_s for s in seeds]
    asyn = [simulate(sim_params(m, "async"), "async", d, s).tokens_per_s for s in seeds]
    s, a = statistics.fmean(sync), statistics.fmean(asyn)
    return {"sync_tokens_per_s": s, "async_tokens_per_s": a, "ratio": a / s if s > 0 else float("inf")}
