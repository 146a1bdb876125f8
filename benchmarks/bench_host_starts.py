"""What a burst of calls on a cold pool of user-code hosts costs (:mod:`saorl.envs.hosted`).

N threads each play one episode (``reset`` and ``step``) at once on a fresh pool, as a worker's env
threads do at the start of a run: every call finds no idle child. Two envs: ``cheap``,
``prompt_reward`` with ``saorl.envs.rewards:number_answer`` (a child imports little), and ``heavy``,
a user env whose module imports torch and ``saorl.stages.value_pretrain``, as a test module or a
real env's does (seconds of CPU per child). Prints the wall time of the burst and the children the
pool started.

    python benchmarks/bench_host_starts.py                   # both envs, 8 and 16 calls at once
    python benchmarks/bench_host_starts.py --env heavy --calls 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from saorl.envs.base import Task
from saorl.envs.registry import EnvFactory, make_env_factory

HEAVY = '''
import torch  # noqa: F401

import saorl.stages.value_pretrain  # noqa: F401
from saorl.envs.base import Env, StepResult


class HeavyEnv(Env):
    name = "heavy"
    max_turns = 1

    def generate_tasks(self, split, n, seed):
        return []

    def reset(self, task, progress=None):
        return "go"

    def step(self, action):
        return StepResult("", float(len(action)), True, {})
'''
TASK = Task("t", {"prompt": "What is 1+2?", "answer": "#### 3"})


def _factory(env: str) -> EnvFactory:
    if env == "heavy":
        return make_env_factory("bench_heavy_env:HeavyEnv", call_timeout_s=120.0)
    return make_env_factory("prompt_reward", {"reward_fn": "saorl.envs.rewards:number_answer"},
                            call_timeout_s=60.0)


def burst(env: str, calls: int) -> tuple[float, int]:
    """(seconds until every one of ``calls`` episodes at once on a cold pool answered, children started)."""
    factory = _factory(env)
    rewards: list[float] = []
    errors: list[BaseException] = []

    def episode() -> None:
        try:
            e = factory()
            e.reset(TASK)
            rewards.append(e.step("The answer is 3").reward)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=episode) for _ in range(calls)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    started = factory.pool.started
    factory.close()
    if errors or len(rewards) != calls:
        raise RuntimeError(f"{len(errors)} of {calls} episodes failed: {errors[:1]}")
    return took, started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=["cheap", "heavy", "both"], default="both")
    ap.add_argument("--calls", type=int, nargs="+", default=[8, 16])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "bench_heavy_env.py").write_text(HEAVY)
        sys.path.insert(0, tmp)  # the children get this sys.path
        print("| env | calls at once | seconds | children started |\n|---|---:|---:|---:|")
        for env in (["cheap", "heavy"] if args.env == "both" else [args.env]):
            for n in args.calls:
                took, started = burst(env, n)
                print(f"| {env} | {n} | {took:.2f} | {started} |", flush=True)


if __name__ == "__main__":
    main()
