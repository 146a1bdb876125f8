"""Evaluation: a policy's episodes on held-out tasks, and the ``eval/*`` metrics of a run.

One evaluation for everything (the run's periodic evaluations, ``saorl eval``, ``saorl sft``'s
before/after, the experiments' final evaluation): :func:`evaluate` plays one episode per task on
a local engine through the in-process backend, task ``i`` sampled with seed index ``i``, so every
evaluation of one config sees the same random stream; :func:`evaluate_config` picks the tasks the
run's config says (the first ``n`` of its test split, as the run's own evaluations do).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from saorl.config import SaorlConfig
from saorl.data.task import Task
from saorl.data.tasks import load_split
from saorl.data.trajectory import Trajectory, env_metric_means
from saorl.engines.base import SamplingParams
from saorl.envs.base import Progress
from saorl.envs.registry import make_env_factory
from saorl.runtime.messages import RolloutRequest


def evaluate(policy, tokenizer, env_factory, tasks: list[Task], *, max_new_tokens: int,
             max_total_tokens: int, slots: int = 16, concurrency: int = 32, temperature: float = 0.0,
             progress: Progress | None = None, seed: int = 0,
             on_done: Callable[[int, int], None] | None = None) -> tuple[dict[str, float], list[Trajectory]]:
    """Run one episode per task; return ``eval/*`` metrics and the trajectories, in task order."""
    from saorl.engines.local import LocalEngine
    from saorl.runtime.inprocess import InProcessBackend, run_requests

    device = next(policy.parameters()).device
    engine = LocalEngine(policy, tokenizer, max_batch_size=slots, version=0, device=device)
    try:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        backend = InProcessBackend(engine, env_factory, tokenizer, sampling=sampling,
                                   max_total_tokens=max_total_tokens, concurrency=concurrency)
        reqs = [RolloutRequest(i, t, progress or Progress()) for i, t in enumerate(tasks)]
        done = run_requests(backend, reqs, on_done)
    finally:
        engine.close()
    trajs = [done[i] for i in range(len(tasks))]
    return eval_metrics(trajs), trajs


def eval_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    if not trajs:
        return {}
    return {
        "eval/accuracy": statistics.fmean(float(t.episode.success) for t in trajs),
        "eval/reward_mean": statistics.fmean(t.total_reward for t in trajs),
        "eval/turns_mean": statistics.fmean(float(t.episode.turns) for t in trajs),
        "eval/action_tokens_mean": statistics.fmean(t.num_action_tokens for t in trajs),
        "eval/truncated_frac": statistics.fmean(float(t.truncated) for t in trajs),
        "eval/episodes": float(len(trajs)),
    } | env_metric_means(trajs, "eval/env/")


def eval_tasks(cfg: SaorlConfig, env_factory, split: str, n: int) -> list[Task]:
    """The first ``n`` tasks of ``split``, as a run sees them (test: the run's test split)."""
    env = env_factory()
    if split == "train":
        return load_split(env, cfg.env, "train", n, cfg.seed)
    return load_split(env, cfg.env, "test", max(n, cfg.env.num_test_tasks), cfg.seed)[:n]


def evaluate_config(cfg: SaorlConfig, policy, tokenizer, *, split: str = "test", n: int | None = None,
                    temperature: float | None = None, progress: Progress | None = None,
                    on_done: Callable[[int, int], None] | None = None) -> tuple[dict[str, float], list]:
    """``eval/*`` metrics and trajectories of ``policy`` on the first ``n`` tasks of ``split``.

    ``n`` None: as many as a run's evaluation uses, ``min(run.eval_tasks, env.num_test_tasks)``;
    ``temperature`` None: ``run.eval_temperature``.
    """
    if n is not None and n < 1:
        raise ValueError(f"the number of evaluation tasks must be >= 1, got {n}")
    env_factory = make_env_factory(cfg.env.type, cfg.env.options)
    tasks = eval_tasks(cfg, env_factory, split, n or min(cfg.run.eval_tasks, cfg.env.num_test_tasks))
    r = cfg.rollout
    temp = cfg.run.eval_temperature if temperature is None else temperature
    return evaluate(policy, tokenizer, env_factory, tasks, max_new_tokens=r.max_new_tokens,
                    max_total_tokens=r.max_total_tokens, slots=r.engine_slots, temperature=temp,
                    progress=progress, seed=cfg.seed, on_done=on_done)


class TestEvaluator:
    """A run's periodic evaluation: the first ``run.eval_tasks`` tasks of its test split."""

    def __init__(self, cfg: SaorlConfig, tokenizer, env_factory, test_tasks: list[Task]) -> None:
        self.cfg, self.tokenizer, self.env_factory = cfg, tokenizer, env_factory
        self.tasks = test_tasks[: cfg.run.eval_tasks]

    def __call__(self, policy, progress: Progress,
                 on_done: Callable[[int, int], None] | None = None) -> dict[str, float]:
        if not self.tasks:
            return {}
        r = self.cfg.rollout
        metrics, _ = evaluate(policy, self.tokenizer, self.env_factory, self.tasks,
                              max_new_tokens=r.max_new_tokens, max_total_tokens=r.max_total_tokens,
                              slots=r.engine_slots, temperature=self.cfg.run.eval_temperature,
                              progress=progress, seed=self.cfg.seed, on_done=on_done)
        return metrics
