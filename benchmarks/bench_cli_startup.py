"""Start-up time of the ``saorl`` command: how long a user waits for help, the env list, a config.

Each command is run as a fresh process (the installed ``saorl`` console script next to this
interpreter, else ``python -m saorl.cli``), ``--repeats`` times, the commands interleaved so that
machine load hits them alike; the first round is a warm-up of the OS file cache and is not counted
("cold-ish": a fresh interpreter, warm disk). Two baselines frame the numbers: a bare interpreter
and ``import torch`` alone, which is what a command that imports the tensor libraries pays on top.
A last column says whether the command's process imported torch at all (run in-process on a
fresh interpreter with ``sys.modules`` checked after ``main``). Prints a Markdown table of medians;
the target is 1.5 s for ``--help``, ``envs list`` and ``config``.

    python benchmarks/bench_cli_startup.py               # 7 counted runs per command
    python benchmarks/bench_cli_startup.py --repeats 15
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 1.5
COMMANDS: list[tuple[str, list[str]]] = [
    ("saorl --version", ["--version"]),
    ("saorl --help", ["--help"]),
    ("saorl envs list", ["envs", "list"]),
    ("saorl config", ["config"]),
    ("saorl train --help", ["train", "--help"]),
    ("saorl serve --help", ["serve", "--help"]),
]
TARGETED = {"saorl --help", "saorl envs list", "saorl config"}
_IMPORTS_TORCH = ("import sys\nfrom saorl.cli import main\ntry:\n    main({args!r})\n"
                  "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")


def _launcher() -> list[str]:
    script = Path(sys.executable).with_name("saorl")
    if script.is_file():
        return [str(script)]
    found = shutil.which("saorl")
    return [found] if found else [sys.executable, "-m", "saorl.cli"]


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return dt


def _imports_torch(args: list[str]) -> bool:
    r = subprocess.run([sys.executable, "-c", _IMPORTS_TORCH.format(args=args)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=True)
    return r.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="counted runs per command (default 7)")
    args = ap.parse_args()
    launcher = _launcher()
    rows = [("python -c pass (baseline)", [sys.executable, "-c", "pass"]),
            ("python -c 'import torch' (baseline)", [sys.executable, "-c", "import torch"])]
    rows += [(name, [*launcher, *argv]) for name, argv in COMMANDS]
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for round_ in range(args.repeats + 1):
        for name, cmd in rows:
            dt = _timed(cmd)
            if round_ > 0:  # round 0 warms the file cache
                times[name].append(dt)
    print(f"launcher: {' '.join(launcher)}; {args.repeats} runs per command after one warm-up round\n")
    print("| command | median s | min s | max s | imports torch | target |")
    print("|---|---:|---:|---:|---|---|")
    argv_of = dict(COMMANDS)
    for name, _ in rows:
        t = times[name]
        med = statistics.median(t)
        torch_col = ("yes" if _imports_torch(argv_of[name]) else "no") if name in argv_of else "-"
        target = (f"{'ok' if med <= TARGET_S else 'SLOW'} (≤ {TARGET_S:g} s)" if name in TARGETED else "")
        print(f"| {name} | {med:.2f} | {min(t):.2f} | {max(t):.2f} | {torch_col} | {target} |")


if __name__ == "__main__":
    main()
