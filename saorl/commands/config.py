"""``saorl config [CONFIG] [overrides...]``: print the resolved config as YAML.

The output is what a run would use and is itself a loadable config file. ``--algo`` appends the
resolved algorithm preset (after overrides) as YAML comments. A bad config prints one paragraph
to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saorl.commands.common import check_env_or_exit, load_file_or_exit
from saorl.config import config_to_yaml, resolved_algo_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="YAML config file (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides parsed as YAML, e.g. algo.eps_high=3.0 model.critic=null")
    parser.add_argument("--algo", action="store_true",
                        help="also print the resolved algorithm preset (as YAML comments)")


def run(args: argparse.Namespace) -> int:
    path, overrides = args.config, list(args.overrides)
    # `saorl config algo.eps_high=3` : the first positional is an override, not a file.
    if path is not None and "=" in path and not Path(path).exists():
        path, overrides = None, [path, *overrides]
    cfg = load_file_or_exit(path, overrides)
    check_env_or_exit("saorl config", cfg)  # the env's type and options, as saorl train checks them
    algo = resolved_algo_dict(cfg) if args.algo else None
    sys.stdout.write(config_to_yaml(cfg))
    if algo is not None:
        import yaml

        sys.stdout.write("# resolved algorithm preset:\n")
        for line in yaml.safe_dump(algo, sort_keys=False).splitlines():
            sys.stdout.write(f"#   {line}\n")
    return 0
