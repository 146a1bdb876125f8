"""``saorl plot RUN_DIR [--out FILE]``: one PNG of a run — reward, held-out accuracy, KL and
update size, critic explained variance, staleness and throughput over trainer steps
(:mod:`saorl.runtime.run_plot`). ``saorl train`` draws the same picture into ``RUN_DIR/run.png``
at the end of a run; this command draws it again, or for a run still going."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory that `saorl train` wrote")
    p.add_argument("--out", type=Path, help="where to write the PNG (default: RUN_DIR/run.png)")


def run(args: argparse.Namespace) -> int:
    from saorl.runtime.run_plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0
