"""What training only the critic's top layers saves in an SAO step (``algo.critic_train_layers``).

    python benchmarks/bench_critic_top.py MODEL --layers none,30,8,4,2 --rounds 2

One process, the model loaded once: for each round, for each setting in turn (interleaved, so a
change in the machine's load falls on every setting alike), a fresh critic is copied from the
policy and a :class:`~saorl.runtime.learner.single.Learner` of the ``sao`` preset with that
``critic_train_layers`` built (``none``: the default, every block's MLP trains) and ``--steps``
timed steps taken on the same synthetic trajectories as ``saorl bench step``
(:func:`saorl.bench.step.trajectories`). Prints a markdown table: the critic's trainable
parameters, the best step's seconds, the critic's seconds in it (every ``critic*`` timing of the
learner, its lower blocks' one pass included) and its share, each setting's step time over the
baseline's (the first setting) — medians over the rounds — and the peak RSS of the process.
One untimed step of the first setting comes before everything (the kernels' set-up); each timed
step is its learner's first or later, so every setting pays the same fresh AdamW state.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch

from saorl.algo.registry import get_preset
from saorl.bench.step import trajectories
from saorl.models.critic import Critic
from saorl.models.loading import load_policy
from saorl.runtime.learner.single import Learner, OptimConfig


def _setting(text: str) -> int | None:
    return None if text == "none" else int(text)


def one(policy, trajs, layers: int | None, steps: int) -> dict:
    """A fresh critic and learner with ``layers``; ``steps`` timed steps (0: one, untimed)."""
    preset = get_preset("sao").with_overrides(critic_train_layers=layers)
    critic = Critic.from_policy(policy, seed=0)
    learner = Learner(policy, critic, preset, OptimConfig(policy_lr=1e-6, critic_lr=5e-6),
                      pad_id=policy.config.pad_token_id or 0)
    best = None
    if not steps:
        learner.step(trajs)
    for _ in range(steps):
        learner.timings.reset()
        t = time.perf_counter()
        learner.step(trajs)
        wall = time.perf_counter() - t
        critic_s = sum(v for k, v in learner.timings.seconds.items() if k.startswith("critic"))
        if best is None or wall < best["step_s"]:
            best = {"step_s": wall, "critic_s": critic_s, "split": dict(learner.timings.seconds)}
    best = best or {}
    best["trainable"] = sum(p.numel() for p in learner.critic_params)
    del learner, critic
    gc.collect()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--layers", default="none,30,8,4,2", help="comma-separated settings; none = every block")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=1, help="timed steps per setting and round")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    settings = [_setting(s) for s in args.layers.split(",")]
    policy = load_policy(args.model)
    trajs = trajectories(policy, args.batch, args.tokens, 0.5)
    runs: dict[int | None, list[dict]] = {s: [] for s in settings}
    one(policy, trajs, settings[0], 0)  # the kernels' set-up, untimed
    for r in range(args.rounds):
        for s in settings:
            res = one(policy, trajs, s, args.steps)
            runs[s].append(res)
            print(f"round {r + 1} layers {s}: step {res['step_s']:.2f} s, critic {res['critic_s']:.2f} s "
                  f"({ {k: round(v, 2) for k, v in res['split'].items()} })", flush=True)
    base = statistics.median(x["step_s"] for x in runs[settings[0]])
    print(f"\n{args.model}: {args.batch} × {args.tokens} tokens, {args.threads} threads, "
          f"{args.rounds} rounds "
          f"interleaved, median of the rounds' best of {args.steps}\n")
    print("| critic_train_layers | critic trains | SAO step | critic | critic's share | step / baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in settings:
        step = statistics.median(x["step_s"] for x in runs[s])
        critic = statistics.median(x["critic_s"] for x in runs[s])
        print(f"| {'none (every block)' if s is None else s} | {runs[s][0]['trainable'] / 1e6:.1f}M | "
              f"{step:.2f} s | {critic:.2f} s | {critic / step:.0%} | {step / base:.2f} |")
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
