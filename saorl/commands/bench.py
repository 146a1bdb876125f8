"""``saorl bench pipeline``: measure async (SAO) vs sync (GRPO barrier) throughput, utilisation, staleness.

    saorl bench pipeline                       # 2 × (sync, async), 60 s each, long-tailed synthetic env
    saorl bench pipeline --quick --out /tmp/b  # 1 × (sync, async), 20 s each (CI)
    saorl bench pipeline --env math_tool trainer.batch_size=8

Trailing ``section.field=value`` arguments override the config of both modes. Writes
``summary.md``, ``timeline.png``, ``measurement.json`` and ``results.json`` into ``--out`` and
prints the summary. See :mod:`saorl.bench.pipeline` and ``docs/performance.md``.
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


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench", None) != "pipeline":
        print("usage: saorl bench pipeline [--quick] [--out DIR] [--budget-s S] [--reps N] "
              "[--env synthetic|math_tool] [overrides...]", file=sys.stderr)
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
