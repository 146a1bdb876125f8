"""Evaluation: a policy's episodes on held-out tasks, and the ``eval/*`` metrics of a run.

One evaluation for everything (the run's periodic evaluations, ``saorl eval``, ``saorl sft``'s
before/after, the experiments' final evaluation): :func:`evaluate` plays one episode per task on
a local engine through the in-process backend, task ``i`` sampled with seed index ``i``, so every
evaluation of one config sees the same random stream; :func:`evaluate_config` picks the tasks the
run's config says (the first ``n`` of its test split, as the run's own evaluations do).

An episode whose call into user code ran past ``env.call_timeout_s`` (a reward function that never
returns) is a **failed** episode: it counts as unsuccessful in ``eval/accuracy`` and in
``eval/failed``, the other means are over the episodes that finished, and ``on_error`` hears one
report naming each (the first line: how many, and the first timeout's message). An evaluation
never waits for a call past its deadline; any other episode error still raises (an env's bug).

Tasks of a mix (``env.mix``: its env's ``task_group`` names each task's part) are also counted per
part: ``eval/<part>/accuracy``, ``eval/<part>/reward_mean``, ``eval/<part>/episodes``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

from saorl.agent.prompts import fitting_tasks
from saorl.config import SaorlConfig
from saorl.config.engines import LocalEngineConfig
from saorl.data.task import Task
from saorl.data.tasks import held_out_seed, load_split
from saorl.data.trajectory import Trajectory, env_metric_means
from saorl.engines.base import SamplingParams
from saorl.envs.base import Progress
from saorl.envs.registry import env_factory_for
from saorl.models.codec import as_run_tokenizer
from saorl.runtime.backends.messages import RolloutRequest


def evaluate(policy, tokenizer, env_factory, tasks: list[Task], *, max_new_tokens: int,
             max_total_tokens: int, engine: LocalEngineConfig | None = None, concurrency: int = 32,
             temperature: float = 0.0,
             progress: Progress | None = None, seed: int = 0,
             on_done: Callable[[int, int], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             on_error: Callable[[str], None] | None = None) -> tuple[dict[str, float], list[Trajectory]]:
    """Run one episode per task; return ``eval/*`` metrics and the trajectories of the episodes
    that finished, in task order. ``should_stop()`` true abandons the evaluation
    (:class:`~saorl.runtime.backends.inprocess.Stopped`); ``on_error`` gets the report of failed episodes."""
    from saorl.engines.local import LocalEngine
    from saorl.runtime.backends.inprocess import InProcessBackend, run_requests

    device = next(policy.parameters()).device
    engine = LocalEngine.from_config(engine or LocalEngineConfig(), policy, tokenizer, device=device)
    try:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        backend = InProcessBackend(engine, env_factory, tokenizer, sampling=sampling,
                                   max_total_tokens=max_total_tokens, concurrency=concurrency)
        reqs = [RolloutRequest(i, t, progress or Progress()) for i, t in enumerate(tasks)]
        timeouts: dict[int, str] = {}
        done = run_requests(backend, reqs, on_done, should_stop=should_stop, timeouts=timeouts)
    finally:
        engine.close()
    trajs = [done[i] for i in range(len(tasks)) if i in done]
    if timeouts and on_error is not None:
        on_error(failure_report(timeouts, tasks))
    group = getattr(getattr(env_factory, "template", None), "task_group", None)
    per_env = group_metrics(tasks, done, set(timeouts), group) if group is not None else {}
    return eval_metrics(trajs, failed=len(timeouts)) | per_env, trajs


def group_metrics(tasks: list[Task], done: dict[int, Trajectory], failed: set[int],
                  group: Callable[[Task], str | None]) -> dict[str, float]:
    """``eval/<name>/accuracy``, ``eval/<name>/reward_mean`` and ``eval/<name>/episodes`` of each
    group of tasks (a mix's parts: ``group(task)`` names a task's part); a failed episode counts as
    unsuccessful, as in ``eval/accuracy``."""
    members: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        name = group(task)
        if name is not None:
            members.setdefault(name, []).append(i)
    out: dict[str, float] = {}
    for name, idx in sorted(members.items()):
        finished = [done[i] for i in idx if i in done]
        episodes = len(finished) + sum(i in failed for i in idx)
        if not episodes:
            continue
        out[f"eval/{name}/accuracy"] = sum(float(t.episode.success) for t in finished) / episodes
        if finished:
            out[f"eval/{name}/reward_mean"] = statistics.fmean(t.total_reward for t in finished)
        out[f"eval/{name}/episodes"] = float(episodes)
    return out


def failure_report(timeouts: dict[int, str], tasks: list[Task]) -> str:
    """One line saying how many episodes failed and the first one's message, then one line each."""
    first = timeouts[min(timeouts)]
    lines = [f"{len(timeouts)} of {len(tasks)} evaluation episodes failed (counted as unsuccessful): {first}"]
    lines += [f"  {timeouts[i]}" for i in sorted(timeouts)]
    return "\n".join(lines)


def eval_metrics(trajs: list[Trajectory], failed: int = 0) -> dict[str, float]:
    """``eval/*`` of finished episodes ``trajs`` and ``failed`` episodes that did not finish (their
    call into user code timed out): those count in ``eval/accuracy`` (as unsuccessful),
    ``eval/failed`` and ``eval/episodes`` only."""
    if not trajs:
        none = {"eval/accuracy": 0.0, "eval/failed": float(failed), "eval/episodes": float(failed)}
        return none if failed else {}
    return {
        "eval/accuracy": sum(float(t.episode.success) for t in trajs) / (len(trajs) + failed),
        "eval/reward_mean": statistics.fmean(t.total_reward for t in trajs),
        "eval/turns_mean": statistics.fmean(float(t.episode.turns) for t in trajs),
        "eval/action_tokens_mean": statistics.fmean(t.num_action_tokens for t in trajs),
        "eval/truncated_frac": statistics.fmean(float(t.cut_short) for t in trajs),
        "eval/failed": float(failed),
        "eval/episodes": float(len(trajs) + failed),
    } | env_metric_means(trajs, "eval/env/")


def eval_tasks(cfg: SaorlConfig, env_factory, split: str, n: int, tokenizer=None) -> list[Task]:
    """The first ``n`` tasks of ``split``, as a run sees them (test: the run's test split; with the
    run's ``tokenizer``, those whose prompts fit its token budget, per ``env.overlong_prompts``,
    whose line goes to stderr: ``saorl eval --json`` keeps stdout for its JSON)."""
    env = env_factory()
    if split == "train":
        tasks = load_split(env, cfg.env, "train", n, cfg.seed)
    else:
        tasks = load_split(env, cfg.env, "test", max(n, cfg.env.num_test_tasks), held_out_seed(cfg))
    if tokenizer is not None:
        r = cfg.rollout
        tasks = fitting_tasks(tasks, env_factory, tokenizer, max_total_tokens=r.max_total_tokens,
                              max_new_tokens=r.max_new_tokens, mode=cfg.env.overlong_prompts,
                              what=f"{split} tasks", log=lambda line: print(line, file=sys.stderr))
    return tasks[:n]


def evaluate_config(cfg: SaorlConfig, policy, tokenizer, *, split: str = "test", n: int | None = None,
                    temperature: float | None = None, progress: Progress | None = None,
                    on_done: Callable[[int, int], None] | None = None,
                    on_error: Callable[[str], None] | None = None) -> tuple[dict[str, float], list]:
    """``eval/*`` metrics and trajectories of ``policy`` on the first ``n`` tasks of ``split``.

    ``n`` None: as many as a run's evaluation uses, ``min(run.eval_tasks, env.num_test_tasks)``;
    ``temperature`` None: ``run.eval_temperature``.
    """
    if n is not None and n < 1:
        raise ValueError(f"the number of evaluation tasks must be >= 1, got {n}")
    factory = env_factory_for(cfg.env)
    with factory as env_factory:
        tasks = eval_tasks(cfg, env_factory, split, n or min(cfg.run.eval_tasks, cfg.env.num_test_tasks),
                           as_run_tokenizer(tokenizer))
        r = cfg.rollout
        temp = cfg.run.eval_temperature if temperature is None else temperature
        return evaluate(policy, tokenizer, env_factory, tasks, max_new_tokens=r.max_new_tokens,
                        max_total_tokens=r.max_total_tokens, engine=r.local_engine, temperature=temp,
                        progress=progress, seed=cfg.seed, on_done=on_done, on_error=on_error)


class TestEvaluator:
    """A run's periodic evaluation: the first ``run.eval_tasks`` tasks of its test split."""

    def __init__(self, cfg: SaorlConfig, tokenizer, env_factory, test_tasks: list[Task]) -> None:
        self.cfg, self.tokenizer, self.env_factory = cfg, tokenizer, env_factory
        self.tasks = test_tasks[: cfg.run.eval_tasks]

    def __call__(self, policy, progress: Progress, on_done: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 on_error: Callable[[str], None] | None = None) -> dict[str, float]:
        if not self.tasks:
            return {}
        r = self.cfg.rollout
        metrics, _ = evaluate(policy, self.tokenizer, self.env_factory, self.tasks,
                              max_new_tokens=r.max_new_tokens, max_total_tokens=r.max_total_tokens,
                              engine=r.local_engine, temperature=self.cfg.run.eval_temperature,
                              progress=progress, seed=self.cfg.seed, on_done=on_done,
                              should_stop=should_stop, on_error=on_error)
        return metrics
