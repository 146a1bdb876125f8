"""``saorl train [CONFIG] [key=value ...] [--resume RUN_DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
                   help="an optional YAML config (default: the built-in SAO on math_tool), then dotted "
                        "overrides such as algo.eps_high=3.0 trainer.steps=50")
    p.add_argument("--resume", metavar="RUN_DIR", type=Path,
                   help="continue a run from its last checkpoint and journal (after a crash or Ctrl-C)")
    p.add_argument("--run-dir", type=Path, help="write the run here instead of run.out_dir/NAME-TIMESTAMP")


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first argument without '=' is the config file; the rest are overrides."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    bad = [a for a in args if "=" not in a]
    if bad:
        raise SystemExit(f"saorl: expected key=value overrides after the config, got {bad[0]!r}")
    return None, list(args)


def run(args: argparse.Namespace) -> int:
    from saorl.config import ConfigError, load_config
    from saorl.runtime.trainer import train

    config_path, overrides = split_config_args(args.args)
    try:
        if args.resume is not None:
            if config_path is not None:
                print("saorl train: --resume takes its config from the run directory; "
                      "give only overrides", file=sys.stderr)
                return 2
            resolved = args.resume / "config.yaml"
            if not resolved.exists():
                print(f"saorl train: {resolved} not found; is {args.resume} a saorl run directory?",
                      file=sys.stderr)
                return 2
            cfg = load_config(resolved, overrides)
        else:
            cfg = load_config(config_path, overrides)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    run_dir, final = train(cfg, args.resume or args.run_dir, resume=args.resume is not None)
    acc = final.get("eval/accuracy")
    print(f"run directory: {run_dir}")
    if final:
        print(f"last step {final.get('step')}: reward {final.get('reward/mean', float('nan')):.3f}"
              + (f", eval accuracy {acc:.3f}" if acc is not None else ""))
    return 0
