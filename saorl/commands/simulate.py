"""``saorl simulate``: predict throughput, utilisation and staleness of sync vs async at any scale.

    saorl simulate                                   # the default GPU-cluster model, sync vs async
    saorl simulate --lengths-from runs/my-run --decode-curve-from curve.json --train-time 0.5:2e-4
    saorl simulate --scale 1,8,64,512,1024 --plot scaling.png

Prints Markdown tables (or JSON with ``--json``). With ``--scale``, each point runs the workload on
that many engines with the batch scaled proportionally and the trainer's seconds per token scaled
down by the same factor (a data-parallel trainer growing with the cluster; its fixed per-step cost
and the publication latency stay). See ``docs/simulator.md``.
"""

from __future__ import annotations

import argparse
import json
import sys

from saorl.sim.model import SimResult, compare
from saorl.sim.params import (
    DecodeCurve,
    LengthDist,
    SimInputError,
    SimParams,
    load_decode_curve,
    load_lengths,
)

_D = SimParams()


def _pair(spec: str, what: str) -> tuple[float, float]:
    parts = spec.split(":")
    try:
        if len(parts) == 2:
            return float(parts[0]), float(parts[1])
    except ValueError:
        pass
    raise SimInputError(f"{what} {spec!r}: expected two numbers A:B")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Discrete-event simulation of rollout engines feeding one trainer, sync (barriered batches) "
        "vs async (SAO). Defaults model a GPU cluster: 8 engines × 64 slots, decode step "
        "0.015 + 0.0002·b s, lognormal lengths mean 2,000 tokens CV 1.0 (cap 16,384), training "
        "5 s + 3e-5 s/token, batch 512, publication 2 s, 4 simulated hours.")
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    a = parser.add_argument
    a("--engines", type=int, default=_D.engines, help="rollout engines (one GPU each)")
    a("--slots", type=int, default=_D.slots, help="decode slots per engine")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--length", default="lognormal:2000:1.0",
                   help="length distribution: lognormal:MEAN:CV or constant:LEN (tokens)")
    g.add_argument("--lengths-from", metavar="PATH",
                   help="empirical lengths: a run dir, samples.jsonl, metrics.jsonl, JSON or text list")
    a("--max-len", type=int, default=_D.lengths.max_len, help="token budget per trajectory (clip)")
    a("--turns", type=int, default=1, help="turns per trajectory (length split evenly)")
    a("--env-latency", type=float, default=0.0, help="seconds of env time between turns")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--decode-curve", default="0.015:0.0002",
                   help="decode step seconds t0:t1 → step_time(b) = t0 + t1·b")
    g.add_argument("--decode-curve-from", metavar="PATH.json",
                   help="measured [[batch, seconds], ...], interpolated piecewise-linearly")
    a("--train-time", default="5:3e-5", help="a:b → one training step takes a + b·tokens seconds")
    a("--publish", type=float, default=_D.publish_s, help="weight publication seconds (trainer blocked)")
    a("--group-size", type=int, default=1, help="G rollouts per prompt")
    a("--group-lengths", choices=("independent", "shared"), default="independent",
      help="shared: a group's rollouts all get one length (the prompt fixes it)")
    a("--batch-size", type=int, default=_D.batch_size, help="trajectories per training step")
    a("--max-staleness", type=int, default=None, help="async: drop groups staler than this")
    a("--shared-resources", action="store_true",
      help="engines and trainer share the chips: each slows the other by --contention")
    a("--contention", type=float, default=_D.contention, help="slowdown factor with --shared-resources")
    a("--duration", type=float, default=4 * 3600.0, help="simulated seconds per run")
    a("--seed", type=int, default=0)
    a("--scale", default=None, metavar="N1,N2,...",
      help="also run at these engine counts (batch ∝ engines, trainer s/token ∝ 1/engines)")
    a("--plot", default=None, metavar="OUT.png", help="write the scaling plot (needs --scale)")
    a("--json", action="store_true", help="print JSON instead of Markdown")


def params_from_args(args: argparse.Namespace) -> SimParams:
    if args.lengths_from:
        lengths = LengthDist("empirical", values=tuple(load_lengths(args.lengths_from)), max_len=args.max_len)
    else:
        lengths = LengthDist.parse(args.length, max_len=args.max_len)
    if args.decode_curve_from:
        decode = load_decode_curve(args.decode_curve_from)
    else:
        decode = DecodeCurve.linear(*_pair(args.decode_curve, "--decode-curve"))
    ta, tb = _pair(args.train_time, "--train-time")
    return SimParams(engines=args.engines, slots=args.slots, decode=decode, lengths=lengths,
                     turns=args.turns, env_latency_s=args.env_latency, train_a=ta, train_b=tb,
                     publish_s=args.publish, group_size=args.group_size, group_lengths=args.group_lengths,
                     batch_size=args.batch_size,
                     max_staleness=args.max_staleness, shared_resources=args.shared_resources,
                     contention=args.contention)


def _parse_scale(spec: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SimInputError(f"--scale {spec!r}: expected comma-separated engine counts") from None
    if not out or min(out) < 1:
        raise SimInputError(f"--scale {spec!r}: engine counts must be ≥ 1")
    return out


# ---------------------------------------------------------------------------------- tables
def mode_table(cmp: dict) -> str:
    rows = ["| mode | traj/s | trained tok/s | trainer idle | slot util | staleness mean / p50 / p90 / max "
            "| dropped | steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in ("sync", "async"):
        r: SimResult = cmp[m]
        rows.append(f"| {m} | {r.trajectories_per_s:.3g} | {r.tokens_per_s:,.0f} | {r.trainer_idle_frac:.1%} "
                    f"| {r.slot_util:.1%} | {r.staleness_mean:.2f} / {r.staleness_p50:g} / "
                    f"{r.staleness_p90:g} / {r.staleness_max} | {r.dropped} | {r.steps} |")
    rows.append(f"\nasync / sync trained tokens/s: **{cmp['ratio_tokens_per_s']:.2f}×**")
    return "\n".join(rows)


def scale_table(points: list[tuple[SimParams, dict]]) -> str:
    rows = ["| engines | batch | sync tok/s | async tok/s | async/sync | slot util sync / async "
            "| trainer idle sync / async | async staleness mean / max |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, c in points:
        s, a = c["sync"], c["async"]
        rows.append(f"| {p.engines} | {p.batch_size} | {s.tokens_per_s:,.0f} | {a.tokens_per_s:,.0f} "
                    f"| {c['ratio_tokens_per_s']:.2f}× | {s.slot_util:.1%} / {a.slot_util:.1%} "
                    f"| {s.trainer_idle_frac:.1%} / {a.trainer_idle_frac:.1%} "
                    f"| {a.staleness_mean:.2f} / {a.staleness_max} |")
    return "\n".join(rows)


def describe(p: SimParams, duration: float) -> str:
    d = p.decode.points
    curve = (f"{d[0][1]:g} + {d[1][1] - d[0][1]:g}·b s" if len(d) == 2 and d[0][0] == 0 and d[1][0] == 1
             else f"measured, {len(d)} points")
    return (f"{p.engines} engines × {p.slots} slots; decode step {curve}; lengths {p.lengths.describe()}"
            f"{f', {p.turns} turns, env {p.env_latency_s:g} s' if p.turns > 1 else ''}; "
            f"train {p.train_a:g} s + {p.train_b:g} s/token; publish {p.publish_s:g} s; "
            f"batch {p.batch_size} (G={p.group_size}"
            f"{', one length per group' if p.group_lengths == 'shared' else ''}); "
            f"max staleness {p.max_staleness}; "
            f"{'shared' if p.shared_resources else 'separate'} resources; {duration:g} s simulated")


def _jsonable(c: dict) -> dict:
    return {k: (v.as_dict() if isinstance(v, SimResult) else v) for k, v in c.items()}


def plot_scaling(points: list[tuple[SimParams, dict]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [p.engines for p, _ in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for m, style in (("sync", "o--"), ("async", "s-")):
        ax1.plot(n, [c[m].tokens_per_s for _, c in points], style, label=m)
    ax1.set(xscale="log", yscale="log", xlabel="rollout engines (GPUs)", ylabel="trained tokens / s",
            title="throughput")
    ax1.legend()
    ax1.grid(True, which="both", alpha=0.3)
    ax2.plot(n, [c["ratio_tokens_per_s"] for _, c in points], "s-", color="C2")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xscale="log", xlabel="rollout engines (GPUs)", ylabel="async / sync trained tokens/s",
            title="async speed-up")
    ax2.set_ylim(bottom=0)
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        params = params_from_args(args)
        scales = _parse_scale(args.scale) if args.scale else []
        if args.plot and not scales:
            raise SimInputError("--plot needs --scale (the plot is throughput vs engines)")
        base = compare(params, args.duration, args.seed)
        points = [(q, compare(q, args.duration, args.seed))
                  for q in (params.scaled(n) for n in scales)]
    except SimInputError as e:
        print(f"saorl simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"params": describe(params, args.duration), **_jsonable(base),
               "scale": [{"engines": q.engines, "batch_size": q.batch_size, **_jsonable(c)}
                         for q, c in points]}
        print(json.dumps(out, indent=1))
    else:
        print(f"{describe(params, args.duration)}\n\n{mode_table(base)}")
        if points:
            print(f"\nscaling (batch ∝ engines, trainer s/token ∝ 1/engines):\n\n{scale_table(points)}")
    if args.plot:
        plot_scaling(points, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0

