"""The simulator's prediction for a measured benchmark: ``measurement.json`` → :class:`SimParams`.

Mapping (one entry of ``measurement.json`` each):

- ``engines`` × ``slots``: the rollout workers and their engine slots;
- ``decode_curve``: measured seconds per decode step vs batch, multiplied by ``prefill_scale``
  (pure-decode tok/s ÷ generation tok/s of the workload): the simulator does not model prefill,
  and the local engine re-prefills each turn's whole context, so that cost is spread over the
  decode steps;
- ``lengths``: action tokens of every trajectory the sync runs finished (sync trains all it
  samples, so these are an unbiased sample of the workload), drawn with replacement;
  ``group_lengths``: ``shared`` when the env fixes a task's length (the synthetic env: a GRPO
  group's members then have one length, so a batch of 4 groups waits for the longest of 4
  draws, not of 16);
- ``train_sao`` / ``train_grpo``: ``(a, b)`` of step seconds ≈ a + b·tokens for the async (SAO) and
  the sync (GRPO) trainer; ``publish_s``: weight publication plus journal appends per step;
- ``contention``: how much slower a stage runs while the other runs too (measured with both at
  once; the larger of the two slowdowns, as the simulator has one factor for both); the
  simulator's ``shared_resources`` model applies it whenever both are busy;
- ``in_situ`` (optional): per mode, how much slower each stage ran inside that mode's runs than
  the isolated model says (:mod:`saorl.bench.insitu`). With ``in_situ=True`` the simulator gets
  the isolated costs times those factors (publication folded into the step) and no contention
  model: it then predicts only how the stages compose.
"""

from __future__ import annotations

import statistics

from saorl.sim import DecodeCurve, LengthDist, SimParams, simulate


def sim_params(m: dict, mode: str, in_situ: bool = False) -> SimParams:
    """Simulator inputs for ``mode`` (``sync``: GRPO groups; ``async``: SAO) from a measurement:
    the isolated stage costs with the contention factor, or (``in_situ``) the stage speeds seen
    inside that mode's runs."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    scale = float(m.get("prefill_scale", 1.0))
    a, b = m["train_grpo"] if mode == "sync" else m["train_sao"]
    publish, contention = float(m["publish_s"]), float(m.get("contention", 1.0))
    if in_situ:
        if mode not in m.get("in_situ", {}):
            raise ValueError(f"measurement has no in-situ stage speeds for {mode!r} (re-run the benchmark)")
        f = m["in_situ"][mode]
        a, b = f["train_scale"] * (a + publish), f["train_scale"] * b
        scale, publish, contention = scale * f["decode_scale"], 0.0, 1.0
    return SimParams(
        engines=int(m["engines"]), slots=int(m["slots"]),
        decode=DecodeCurve.measured([(bb, s * scale) for bb, s in m["decode_curve"]]),
        lengths=LengthDist("empirical", values=tuple(int(x) for x in m["lengths"]), max_len=10**6),
        train_a=float(a), train_b=float(b), publish_s=publish,
        group_size=int(m["group_size"]) if mode == "sync" else 1, batch_size=int(m["batch_size"]),
        group_lengths=m.get("group_lengths", "independent"),
        shared_resources=contention > 1.0, contention=max(1.0, contention))


def predict(m: dict, seeds: tuple[int, ...] = (0, 1, 2, 3), in_situ: bool = False) -> dict:
    """Simulated sync and async trained tokens/s over the measured window, mean over ``seeds``."""
    d = float(m["duration_s"])
    sync = [simulate(sim_params(m, "sync", in_situ), "sync", d, s).tokens_per_s for s in seeds]
    asyn = [simulate(sim_params(m, "async", in_situ), "async", d, s).tokens_per_s for s in seeds]
    s, a = statistics.fmean(sync), statistics.fmean(asyn)
    return {"sync_tokens_per_s": s, "async_tokens_per_s": a, "ratio": a / s if s > 0 else float("inf")}
