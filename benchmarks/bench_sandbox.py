"""Per-call overhead of the bubblewrap sandbox vs a plain subprocess, for ``print(1)``.

Both sides run the same interpreter (``sys.executable``): the sandbox through
:func:`saorl.envs.sandbox.run_python` (bwrap, namespaces, in-box bootstrap, rlimits, capped
reads, scratch setup and cleanup), the baseline as ``subprocess.run([python, "-I", "-c",
"print(1)"])``. Each is timed sequentially and with 4 threads issuing calls concurrently (per-call
latency; the wall time of the concurrent phase gives calls/s). The phases are interleaved so
machine load hits both sides alike. Prints a Markdown table of median and p90 milliseconds.

    python benchmarks/bench_sandbox.py            # 40 calls per cell
    python benchmarks/bench_sandbox.py --calls 100
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from saorl.envs.sandbox import ensure_available, run_python


def _sandboxed() -> None:
    r = run_python("print(1)")
    if r.stdout != "1\n" or r.returncode != 0:
        raise RuntimeError(f"sandbox call failed: {r}")


def _plain() -> None:
    r = subprocess.run([sys.executable, "-I", "-c", "print(1)"], capture_output=True, text=True, check=True)
    if r.stdout != "1\n":
        raise RuntimeError(f"plain call failed: {r}")


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _sequential(fn: Callable[[], None], calls: int) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    lat = [_timed(fn) for _ in range(calls)]
    return lat, time.perf_counter() - t0


def _threaded(fn: Callable[[], None], calls: int, threads: int) -> tuple[list[float], float]:
    lat: list[float] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for _ in range(n):
            dt = _timed(fn)
            with lock:
                lat.append(dt)

    share = [calls // threads + (i < calls % threads) for i in range(threads)]
    ts = [threading.Thread(target=worker, args=(n,)) for n in share]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat, time.perf_counter() - t0


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="calls per cell")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    ensure_available()
    sides = {"bwrap sandbox": _sandboxed, "plain subprocess": _plain}
    for fn in sides.values():  # warm the page cache and the probe
        fn()
    rows = []
    for mode in ("sequential", f"{args.threads} threads"):
        for name, fn in sides.items():
            if mode == "sequential":
                lat, wall = _sequential(fn, args.calls)
            else:
                lat, wall = _threaded(fn, args.calls, args.threads)
            rows.append((name, mode, statistics.median(lat) * 1000, _p(lat, 0.9), len(lat) / wall))
    print(f"| side | mode | median ms | p90 ms | calls/s |  ({args.calls} calls per row)")
    print("|---|---|---:|---:|---:|")
    for name, mode, med, p90, rate in rows:
        print(f"| {name} | {mode} | {med:.1f} | {p90:.1f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
