"""Evaluation of a policy on an env's held-out test split (greedy by default)."""

from __future__ import annotations

import asyncio
import statistics

from saorl.data.trajectory import Trajectory
from saorl.engines.base import SamplingParams
from saorl.envs.base import Progress, Task


def evaluate(policy, tokenizer, env_factory, tasks: list[Task], *, max_new_tokens: int,
             max_total_tokens: int, slots: int = 16, concurrency: int = 32, temperature: float = 0.0,
             progress: Progress | None = None, seed: int = 0) -> tuple[dict[str, float], list[Trajectory]]:
    """Run one episode per task; return ``eval/*`` metrics and the trajectories."""
    from saorl.agent.loop import run_episodes
    from saorl.engines.local import LocalEngine

    device = next(policy.parameters()).device
    engine = LocalEngine(policy, tokenizer, max_batch_size=slots, version=0, device=device)
    try:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        trajs = asyncio.run(run_episodes(engine, env_factory, tasks, tokenizer, concurrency=concurrency,
                                         sampling=sampling, max_total_tokens=max_total_tokens,
                                         progress=progress))
    finally:
        engine.close()
    return eval_metrics(trajs), trajs


def eval_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    if not trajs:
        return {}
    return {
        "eval/accuracy": statistics.fmean(float(bool(t.metadata.get("success"))) for t in trajs),
        "eval/reward_mean": statistics.fmean(t.total_reward for t in trajs),
        "eval/turns_mean": statistics.fmean(float(t.metadata.get("turns", 0)) for t in trajs),
        "eval/action_tokens_mean": statistics.fmean(t.num_action_tokens for t in trajs),
        "eval/truncated_frac": statistics.fmean(float(t.truncated) for t in trajs),
        "eval/episodes": float(len(trajs)),
    }
