"""``saorl bench pipeline``: measure async (SAO) vs sync (GRPO barrier) throughput, utilisation, staleness.
``saorl bench step MODEL``: one SAO trainer step of a model against this machine's matmul peak.

    saorl bench pipeline                       # 2 × (sync, async), 60 s each, long-tailed synthetic env
    saorl bench pipeline --quick --out /tmp/b  # 1 × (sync, async), 20 s each (CI)
    saorl bench pipeline --env math_tool trainer.batch_size=8

Trailing ``section.field=value`` arguments override the config of both modes. Writes
``summary.md``, ``timeline.png``, ``measurement.json`` and ``results.json`` into ``--out`` and
prints the summary. See :mod:`saorl.bench.pipeline` and ``docs/performance.md``.

    saorl bench step smollm2-135m-instruct     # 8 trajectories of 128 tokens, 2 timed steps
    saorl bench step DIR --batch 4 --tokens 256 --json out.json

See :mod:`saorl.bench.step`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    p = sub.add_parser("pipeline", help="async vs sync trained tokens/s, idle, slot utilisation, staleness",
                       description="measure async (SAO) vs sync (GRPO barrier) throughput, "
                       "utilisation and staleness on this machine")
    p.add_argument("--quick", action="store_true", help="1 rep of 20 s per mode, short profiles")
    p.add_argument("--out", default="bench-pipeline", help="output directory")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock seconds per run (default 60; quick 20)")
    p.add_argument("--reps", type=int, default=None,
                   help="interleaved (sync, async) pairs (default 2; quick 1)")
    p.add_argument("--sync-sao", action="store_true",
                   help="also run SAO behind the sync barrier (same algorithm as async)")
    p.add_argument("--env", choices=("synthetic", "math_tool"), default="synthetic",
                   help="synthetic: lognormal episode lengths (mean 4 turns × 16 tokens, CV 1.5)")
    p.add_argument("overrides", nargs="*", help="config overrides section.field=value (both modes)")
    s = sub.add_parser("step", help="one SAO trainer step of a model against this machine's matmul peak",
                       description="time one SAO trainer step (policy, critic with K = 2, AdamW) of a "
                       "model on synthetic trajectories, split it, and compare its FLOP/s with this "
                       "machine's measured matmul peak")
    s.add_argument("model", help="a model directory, a GGUF file, a short name (smollm2-135m-instruct, "
                   "gemma3-270m), a Hub id or a tiny kind")
    s.add_argument("--batch", type=int, default=8, help="trajectories a step")
    s.add_argument("--tokens", type=int, default=128, help="tokens a trajectory")
    s.add_argument("--action-frac", type=float, default=0.5, help="the action's share of each trajectory")
    s.add_argument("--steps", type=int, default=2, help="timed steps after a warm-up one (the best counts)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--device", default="cpu")
    s.add_argument("--autocast", action="store_true",
                   help="the steps under bfloat16 autocast (weights and optimizer float32)")
    s.add_argument("--json", default=None, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench", None) == "step":
        return _step(args)
    if getattr(args, "bench", None) != "pipeline":
        print("usage: saorl bench pipeline [--quick] [--out DIR] [--budget-s S] [--reps N] "
              "[--env synthetic|math_tool] [overrides...]\n"
              "       saorl bench step MODEL [--batch N] [--tokens N] [--steps N] [--threads N] [--json OUT]",
              file=sys.stderr)
        return 2
    from saorl.bench.pipeline import BenchSpec, bench
    from saorl.bench.report import summary_markdown
    from saorl.config import ConfigError

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"saorl bench pipeline: overrides must look like section.field=value, got {bad}",
              file=sys.stderr)
        return 2
    kw = {"env": args.env, "overrides": list(args.overrides), "sync_sao": args.sync_sao}
    if args.budget_s is not None:
        if args.budget_s <= 0:
            print(f"saorl bench pipeline: --budget-s must be > 0, got {args.budget_s}", file=sys.stderr)
            return 2
        kw["budget_s"] = args.budget_s
    if args.reps is not None:
        if args.reps < 1:
            print(f"saorl bench pipeline: --reps must be >= 1, got {args.reps}", file=sys.stderr)
            return 2
        kw["reps"] = args.reps
    spec = BenchSpec.quick(**kw) if args.quick else BenchSpec(**kw)
    command = "saorl bench pipeline " + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "pipeline"]
                                                   else [])
    try:
        result = bench(spec, Path(args.out), command=command.strip())
    except ConfigError as e:
        print(f"saorl bench pipeline: {e}", file=sys.stderr)
        return 2
    print(summary_markdown(result))
    return 0


def _step(args: argparse.Namespace) -> int:
    import json

    from saorl.bench.step import StepSpec, bench_step, format_step

    for name in ("batch", "tokens", "steps"):
        if getattr(args, name) < 1:
            print(f"saorl bench step: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.tokens < 2 or not 0 < args.action_frac < 1:
        print(f"saorl bench step: need --tokens >= 2 and 0 < --action-frac < 1, got {args.tokens} and "
              f"{args.action_frac}", file=sys.stderr)
        return 2
    spec = StepSpec(args.model, batch=args.batch, tokens=args.tokens, action_frac=args.action_frac,
                    steps=args.steps, threads=args.threads, device=args.device,
                    autocast=args.autocast)
    try:
        result = bench_step(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (OSError, ValueError) as e:
        print(f"saorl bench step: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(format_step(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
