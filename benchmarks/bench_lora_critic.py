"""The default critic vs a LoRA critic (``model.lora.critic``), side by side: what trains, what a
step costs, how well it fits held-out returns.

    python benchmarks/bench_lora_critic.py                          # tiny-dense and tiny-moe
    python benchmarks/bench_lora_critic.py --models tiny-dense --steps 50

For each model, critics copied from the same policy (seed 0) are fitted by value pretraining's own
routine (:func:`saorl.stages.value_pretrain.fit_critic`, the ``sao`` preset: Monte-Carlo returns
along the action chain, AdamW at a constant learning rate, gradient clip 1) on the same rollouts:

- ``default``: the default critic design (frozen attention; the MLP / expert projections and the
  value head train), at ``--lr`` (value pretraining's default, 1e-3);
- ``LoRA r<k>``: the trunk frozen whole, a LoRA adapter (alpha 16, the default targets) and the
  value head train (:func:`saorl.models.lora.attach_critic_lora`, as ``model.lora.critic`` does),
  at ``--lr`` and at ``--lora-lr`` (adapters usually want a larger step).

The rollouts are synthetic with a learnable return: a prompt of 16-24 random tokens holds one
marker token, 7 or 9, at a random place; the action tokens (two turns of 12-20, an observation of
6-10 between) are random, and the last token earns 1 when the marker was 7, else 0. So the value
of every action token is the marker's class, which a critic must carry from the prompt through its
(frozen, in the default design) attention. 20% of the rollouts are held out, as value pretraining
does; the held-out value loss and explained variance come from
:func:`saorl.stages.value_pretrain.critic_metrics`.

Measured: trainable critic parameters; the seconds per optimizer step (the fit's wall time over its
steps; the fits run one after another, so the load average printed per row says what shared the
CPU); held-out value loss and explained variance before and after the fit. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from saorl.algo.registry import get_preset
from saorl.config.sections import LORA_TARGETS
from saorl.data.trajectory import Episode, Trajectory
from saorl.models.critic import Critic
from saorl.models.lora import attach_critic_lora
from saorl.models.tiny import build_tiny
from saorl.stages.value_pretrain import critic_metrics, fit_critic

PAD = 1
MARKERS = (7, 9)
"""The marker tokens: 7 earns the reward, 9 does not."""


def rollouts(n: int, seed: int = 0) -> list[Trajectory]:
    """``n`` two-turn rollouts whose return is the class of the marker in their prompt (module docstring)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, a1, o, a2 = rng.randint(16, 24), rng.randint(12, 20), rng.randint(6, 10), rng.randint(12, 20)
        ids = [rng.randint(10, 1023) for _ in range(p + a1 + o + a2)]
        marker = MARKERS[i % 2]
        ids[rng.randrange(p)] = marker
        mask = [0] * p + [1] * a1 + [0] * o + [1] * a2
        rewards = [0.0] * len(ids)
        rewards[-1] = float(marker == MARKERS[0])
        out.append(Trajectory(ids, mask, [0.0] * len(ids), rewards, [0 if m else -1 for m in mask], p,
                              task_id=f"t{i}", episode=Episode(success=rewards[-1] > 0)))
    rng.shuffle(out)
    return out


def critic_of(kind: str, rank: int | None) -> Critic:
    """A critic copied from the ``kind`` policy of seed 0: the default design, or with a LoRA adapter."""
    critic = Critic.from_policy(build_tiny(kind, seed=0), seed=0)
    if rank is not None:
        attach_critic_lora(critic, rank=rank, alpha=16.0, dropout=0.0, targets=list(LORA_TARGETS),
                           optional=LORA_TARGETS, seed=0)
    return critic


def measure(kind: str, variants: dict[str, tuple[int | None, float]], *, rollouts_n: int, steps: int,
            batch: int) -> dict[str, dict[str, float]]:
    """For each variant ``name: (LoRA rank or None, learning rate)``: trainable parameters, seconds
    per step, held-out loss / explained variance before and after ``steps`` steps."""
    trajs = rollouts(rollouts_n)
    cut = len(trajs) - max(1, round(0.2 * len(trajs)))
    train, val = trajs[:cut], trajs[cut:]
    preset = get_preset("sao")
    out = {}
    for name, (rank, lr) in variants.items():
        critic = critic_of(kind, rank)
        critic.set_frozen_attention(preset.freeze_critic_attention)
        before = critic_metrics(critic, val, preset, pad_id=PAD, batch_size=batch)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        fit = fit_critic(critic, train, preset, steps=steps, batch_size=batch, lr=lr, grad_clip=1.0,
                         pad_id=PAD, seed=0)
        step_s = (time.perf_counter() - t0) / steps
        after = critic_metrics(critic, val, preset, pad_id=PAD, batch_size=batch)
        out[name] = {"params": sum(p.numel() for p in critic.trainable_parameters()),
                     "all_params": sum(p.numel() for p in critic.parameters()), "lr": lr, "step_s": step_s,
                     "loss0": before["loss"], "loss": after["loss"], "ev": after["explained_var"],
                     "train_loss": fit["critic/value_loss"], "load": load}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-dense,tiny-moe", help="comma-separated tiny kinds")
    ap.add_argument("--rollouts", type=int, default=160, help="rollouts (20%% held out)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps of each fit")
    ap.add_argument("--batch", type=int, default=16, help="rollouts per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate of the default critic (and LoRA)")
    ap.add_argument("--lora-lr", type=float, default=1e-2, help="the LoRA critics' second learning rate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = {"default": (None, args.lr), "LoRA r8": (8, args.lr), "LoRA r8 ": (8, args.lora_lr),
                "LoRA r16": (16, args.lora_lr)}
    print(f"# value fits of {args.steps} steps of {args.batch} rollouts ({args.rollouts} rollouts, 20% held "
          f"out); {args.threads} torch thread(s)")
    print("| model | critic | lr | trainable params | s / step | held-out loss (unfitted → fitted) | "
          "held-out EV | load avg |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.models.split(","):
        for name, r in measure(kind, variants, rollouts_n=args.rollouts, steps=args.steps,
                               batch=args.batch).items():
            print(f"| {kind} | {name.strip()} | {r['lr']:g} | {r['params']:,} of {r['all_params']:,} | "
                  f"{r['step_s']:.3f} | {r['loss0']:.4f} → {r['loss']:.4f} | {r['ev']:.3f} | "
                  f"{r['load']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
