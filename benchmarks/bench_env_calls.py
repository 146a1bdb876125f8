"""What the deadline on user code costs per call: ``prompt_reward`` in-process vs hosted.

One episode of ``prompt_reward`` is a ``reset`` and a ``step`` (which calls the reward function).
In-process (``env.call_timeout_s=null``) both run in the caller's thread; hosted (the default,
:mod:`saorl.envs.hosted`) each is a round trip to a warm child process: the env pickled there and
back, the call, the answer. The reward function is ``saorl.envs.rewards:number_answer`` on a
GSM8K-like row. Each side plays ``--episodes`` episodes sequentially and with ``--threads`` threads
at once (as the agent loop's env threads do), interleaved so that machine load hits both alike;
the children are started before timing (warm, as in a run). Prints a Markdown table of the median
and p90 microseconds per call (``reset`` and ``step`` alike), the children the pool started and
their resident memory, and what a cold child costs (a killed one's replacement: start, imports,
first call).

    python benchmarks/bench_env_calls.py                 # 2000 episodes per cell
    python benchmarks/bench_env_calls.py --episodes 500 --threads 4
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

from saorl.envs.base import Task
from saorl.envs.registry import EnvFactory, make_env_factory

TASK = Task("gsm8k-1", {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
                "in May. How many clips did she sell altogether?",
    "answer": "Natalia sold 48/2 = 24 clips in May. 48+24 = 72 clips. #### 72"})
COMPLETION = "She sold 48 in April and 24 in May, so 48 + 24 = 72. The answer is 72."


def _factory(timeout_s: float | None) -> EnvFactory:
    return make_env_factory("prompt_reward", {"reward_fn": "saorl.envs.rewards:number_answer",
                                              "prompt_column": "question"}, call_timeout_s=timeout_s)


def _episode(factory: EnvFactory, lat: list[float]) -> None:
    env = factory()
    t0 = time.perf_counter()
    env.reset(TASK)
    t1 = time.perf_counter()
    result = env.step(COMPLETION)
    t2 = time.perf_counter()
    if result.reward != 1.0:
        raise RuntimeError(f"unexpected reward {result.reward}")
    lat += [t1 - t0, t2 - t1]


def _run(factory: EnvFactory, episodes: int, threads: int) -> list[float]:
    lat: list[float] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        mine: list[float] = []
        for _ in range(n):
            _episode(factory, mine)
        with lock:
            lat.extend(mine)

    ts = [threading.Thread(target=worker, args=(episodes // threads,)) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat


def _cell(lat: list[float]) -> str:
    us = sorted(x * 1e6 for x in lat)
    return f"{statistics.median(us):.1f} | {us[int(0.9 * (len(us) - 1))]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per cell")
    ap.add_argument("--starts", type=int, default=10, help="cold starts of a child to time")
    args = ap.parse_args()
    sides: dict[str, Callable[[], EnvFactory]] = {"in-process": lambda: _factory(None),
                                                  "hosted (warm child)": lambda: _factory(60.0)}
    factories = {name: make() for name, make in sides.items()}
    for f in factories.values():  # warm: start the children a run would already have
        _run(f, 4 * args.threads, args.threads)
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for threads in (1, args.threads):
            for name, f in factories.items():
                results.setdefault((name, threads), []).extend(_run(f, args.episodes // args.rounds, threads))
    print("| side | threads | median µs/call | p90 µs/call |")
    print("|---|---|---|---|")
    for (name, threads), lat in results.items():
        print(f"| {name} | {threads} | {_cell(lat)} |")
    hosted = factories["hosted (warm child)"]
    rss = [_rss_mb(pid) for pid in hosted.pool.pids()]
    print(f"\nchildren started by the hosted pool: {hosted.pool.started}; resident memory of each: "
          + ", ".join(f"{r:.0f} MiB" for r in rss))
    for f in factories.values():
        f.close()
    starts = []
    for _ in range(args.starts):  # what a killed child's replacement costs: start, imports, handshake
        with _factory(60.0) as f:
            t0 = time.perf_counter()
            f().reset(TASK)
            starts.append(time.perf_counter() - t0)
    median, worst = statistics.median(starts) * 1e3, max(starts) * 1e3
    print(f"a cold child (start + first call), {args.starts} times: median {median:.0f} ms, "
          f"max {worst:.0f} ms")


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
