"""One trainer update (``Learner.step``) on the pipeline benchmark's workload, variant by variant.

    python benchmarks/bench_train_step.py                       # sao and grpo, packed vs padded, 1 thread
    python benchmarks/bench_train_step.py --compile --threads 1,2

Batches of 16 trajectories shaped like ``saorl bench pipeline``'s: the synthetic env's tasks
(lognormal turns, mean 4, CV 1.5, at most 32), 16 action tokens per turn, a one-token observation
between turns, the env's own prompt; token ids drawn at random (the cost of a step does not depend
on which tokens they are). Variants, timed interleaved after one warm-up step each, ``--rounds``
rounds of ``--steps`` steps, every round on batches not seen before (a compiled model meets new
shapes, as in a run); the best round counts, a load spike only ever slows one:

- ``padded``: ``trainer.packing=false`` with one micro-batch — every row padded to the longest of
  the batch, the layout before packing;
- ``packed``: ``trainer.packing=true``, ``max_tokens_per_microbatch`` 4096 (the default);
- ``packed+compile`` (``--compile``): the same with the policy's and the critic trunk's forward
  wrapped in ``torch.compile(dynamic=True)``.

Prints ms per step, trained action tokens / s and positions per action token, with the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from saorl.algo.registry import get_preset
from saorl.data.trajectory import Episode, Trajectory
from saorl.envs.synthetic import SyntheticLengthEnv
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.learner.single import Learner, OptimConfig


def workload(n: int, seed: int = 0, turn_tokens: int = 16) -> list[Trajectory]:
    env = SyntheticLengthEnv(mean_turns=4.0, cv=1.5, max_turns=32)
    tok = load_tokenizer()
    rng = random.Random(seed)
    out = []
    for task in env.generate_tasks("train", n, seed):
        prompt = tok.encode(env.reset(task), add_special_tokens=False)
        ids, mask = list(prompt), [0] * len(prompt)
        for k in range(task.data["turns"]):
            ids += [rng.randint(2, 1023) for _ in range(turn_tokens)]
            mask += [1] * turn_tokens
            if k < task.data["turns"] - 1:
                ids += tok.encode("\n", add_special_tokens=False)
                mask += [0]
        rewards = [0.0] * len(ids)
        rewards[len(ids) - 1] = rng.random()
        out.append(Trajectory(ids, mask, [rng.uniform(-7.2, -6.6) if m else 0.0 for m in mask], rewards,
                              [0 if m else -1 for m in mask], len(prompt), task_id=task.id,
                              episode=Episode(success=rewards[-1] > 0.5)))
    return out


def learner(algo: str, variant: str) -> Learner:
    preset = get_preset(algo)
    policy = build_tiny("tiny-moe", seed=0)
    critic = Critic.from_policy(policy) if preset.use_critic else None
    packed = variant != "padded"
    lrn = Learner(policy, critic, preset, OptimConfig(), pad_id=1, packing=packed,
                  max_tokens_per_microbatch=4096 if packed else 10**9)
    if variant.endswith("+compile"):
        policy.forward = torch.compile(policy.forward, dynamic=True)
        if critic is not None:
            critic.trunk.forward = torch.compile(critic.trunk.forward, dynamic=True)
    return lrn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", default="sao,grpo")
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd forwards")
    args = ap.parse_args(argv)
    variants = ["padded", "packed"] + (["packed+compile"] if args.compile else [])
    trajs = workload(16 * (args.steps * args.rounds + 1), seed=1)
    batches = [trajs[i * 16:(i + 1) * 16] for i in range(args.steps * args.rounds + 1)]
    rounds = [batches[1 + k * args.steps:1 + (k + 1) * args.steps] for k in range(args.rounds)]
    tokens = sum(t.num_action_tokens for b in batches[1:] for t in b) / args.rounds
    print(f"# Learner.step, tiny-moe, batches of 16, {tokens / args.steps:.0f} action tokens a step (mean); "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    print("| algo | threads | variant | ms / step | action tok/s | positions / action token |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for algo in args.algos.split(","):
        g = get_preset(algo).group_size
        gids = [i // g for i in range(16)]
        for threads in (int(x) for x in args.threads.split(",")):
            torch.set_num_threads(threads)
            lrns = {v: learner(algo, v) for v in variants}
            for lrn in lrns.values():
                lrn.step(batches[0], gids)  # warm-up (and compilation)
            rate = {v: 0.0 for v in variants}
            ms_step, ratio = {}, {}
            for batches_k in rounds:
                n = sum(t.num_action_tokens for b in batches_k for t in b)
                for v, lrn in lrns.items():
                    t0 = time.perf_counter()
                    ms = [lrn.step(b, gids) for b in batches_k]
                    dt = time.perf_counter() - t0
                    if n / dt > rate[v]:
                        rate[v], ms_step[v] = n / dt, dt / args.steps
                    ratio[v] = statistics.fmean(m["throughput/positions_per_action_token"] for m in ms)
            for v in variants:
                print(f"| {algo} | {threads} | {v} | {1000 * ms_step[v]:.0f} | {rate[v]:.0f} | "
                      f"{ratio[v]:.2f} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
