"""Supervised fine-tuning of the initial policy on an env's demonstrations.

Demonstrations are played through the very same agent loop as rollouts (a scripted engine
"samples" the demonstration's actions), so the SFT data has the exact multi-turn token layout
RL will see. The loss is the mean negative log-likelihood of the **action tokens only**
(prompt and observation tokens are context, never targets). The result is the "SFT model" that
RL runs start from; how good it is depends on the env's ``demo_error_rate`` option.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from saorl.algo.losses import masked_mean
from saorl.data.batch import collate
from saorl.data.trajectory import Trajectory
from saorl.envs.base import Task
from saorl.models.logprobs import token_logprobs


@dataclass
class SFTConfig:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    seed: int = 0


def demonstrations(env_factory: Callable, tasks: list[Task], tokenizer, seed: int,
                   concurrency: int = 8) -> list[Trajectory]:
    """One demonstration trajectory per task (deterministic in ``seed``)."""
    from saorl.agent.scripted import demonstration_trajectory

    rngs = [random.Random(f"{seed}:{t.id}") for t in tasks]  # independent of completion order

    async def _all() -> list[Trajectory]:
        sem = asyncio.Semaphore(concurrency)

        async def one(task: Task, rng: random.Random) -> Trajectory:
            async with sem:
                return await demonstration_trajectory(env_factory(), task, tokenizer, rng)

        return list(await asyncio.gather(*(one(t, r) for t, r in zip(tasks, rngs))))

    return asyncio.run(_all())


def _lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def sft(policy: torch.nn.Module, demos: list[Trajectory], pad_id: int, cfg: SFTConfig,
        on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
    """Train ``policy`` in place on ``demos``; return the last step's metrics."""
    if not demos:
        raise ValueError("sft needs at least one demonstration")
    gen = random.Random(cfg.seed)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    order: list[int] = []
    metrics: dict[str, float] = {}
    policy.train()
    t0 = time.monotonic()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            more = list(range(len(demos)))
            gen.shuffle(more)
            order += more
        idx, order = order[: cfg.batch_size], order[cfg.batch_size:]
        batch = collate([demos[i] for i in idx], pad_id)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        logprobs = token_logprobs(policy, batch.input_ids, batch.attention_mask)
        loss = -masked_mean(logprobs, batch.action_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if torch.isfinite(loss) and torch.isfinite(norm):
            opt.step()
        metrics = {"sft/loss": float(loss.detach()), "sft/grad_norm": float(norm),
                   "sft/lr": opt.param_groups[0]["lr"], "sft/elapsed_s": time.monotonic() - t0}
        if on_step is not None:
            on_step(step + 1, metrics)
    policy.eval()
    return metrics
