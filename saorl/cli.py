"""The ``saorl`` command line.

Each subcommand lives next to the code it drives and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int``. This file only lists them, so adding a
command is one line in :data:`COMMANDS` and the import cost of one command is not paid by others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("saorl.runtime.train_cmd", "train a policy with SAO or a baseline (default: SAO on math_tool)"),
    "eval": ("saorl.runtime.eval_cmd", "evaluate a run or checkpoint on an env's test split"),
    "sft": ("saorl.runtime.sft_cmd", "fine-tune a policy on an env's demonstrations; accuracy before/after"),
    "value-pretrain": ("saorl.runtime.value_pretrain_cmd", "fit a critic on rollouts of a fixed policy"),
    "serve": ("saorl.engines.serve", "serve the local engine over OpenAI-compatible HTTP"),
    "envs": ("saorl.envs.cli", "list environments, sample tasks and demonstrations"),
    "config": ("saorl.config_cmd", "print the resolved config (defaults, YAML and overrides)"),
    "simulate": ("saorl.sim.cli",
                 "predict throughput, utilisation and staleness of sync vs async at any scale"),
    "bench": ("saorl.bench.cli", "measure async vs sync throughput, utilisation and staleness"),
    "experiment": ("saorl.experiments.cli",
                   "run a comparison of algorithms or ablations and write its table and plots"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saorl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
            continue
        mod.add_arguments(p)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may also come after a command's options
    (``saorl experiment math --quick run.progress=false``), where argparse alone rejects them."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if isinstance(getattr(args, "overrides", None), list) and all(
                "=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if args.version:
        from saorl import __version__

        print(f"saorl {__version__}")
        return 0
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"saorl {args.command}: not yet implemented in this version", file=sys.stderr)
        return 3
    mod = importlib.import_module(args._module)
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
