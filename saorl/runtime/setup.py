"""Building the parts of a run from its config: models, env, tasks, backend, evaluation.

Kept apart from the loop so that :mod:`saorl.runtime.trainer` reads as the algorithm and this
file as the wiring. The config is unpacked here, at the call sites; nothing below reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from saorl.algo.registry import AlgoPreset
from saorl.config import SaorlConfig
from saorl.engines.base import SamplingParams
from saorl.envs.base import Progress, Task
from saorl.envs.registry import load_tasks, make_env_factory
from saorl.models.checkpoint import export_policy, save_critic
from saorl.models.critic import Critic
from saorl.models.loading import load_policy
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.backend import LocalBackend
from saorl.runtime.evaluate import evaluate
from saorl.runtime.worker import WorkerSpec


@dataclass
class RunParts:
    preset: AlgoPreset
    mode: str
    tokenizer: object
    policy: torch.nn.Module
    critic: Critic | None
    env_factory: Callable
    train_tasks: list[Task]
    test_tasks: list[Task]
    backend: LocalBackend
    evaluate: Callable[[torch.nn.Module, Progress], dict]
    write_samples: Callable[[Path, int, list], None]
    export_final: Callable[[Path, object], None]


def sampling_params(cfg: SaorlConfig, temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature if temperature is None else temperature,
                          top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)


def build_tasks(cfg: SaorlConfig, env_factory) -> tuple[list[Task], list[Task]]:
    env = env_factory()
    train = load_tasks(env, "train", cfg.env.num_train_tasks, cfg.seed, cfg.env.tasks_file)
    test = load_tasks(env, "test", cfg.env.num_test_tasks, cfg.seed,
                      getattr(cfg.env, "test_tasks_file", None) if cfg.env.tasks_file else None)
    if not train:
        raise ValueError(f"env {cfg.env.type!r} produced no training tasks")
    return train, test


def build_critic(cfg: SaorlConfig, policy, preset: AlgoPreset, critic_spec: str | None) -> Critic | None:
    """None without a critic; a saved (value-pretrained) critic; else a copy of the policy's trunk."""
    if not preset.use_critic:
        return None
    if critic_spec:
        from saorl.models.checkpoint import load_critic

        return load_critic(critic_spec, device=cfg.model.device)
    return Critic.from_policy(policy, seed=cfg.seed)


def build_parts(cfg: SaorlConfig, run_dir: Path, policy_spec: str, critic_spec: str | None) -> RunParts:
    if cfg.runtime.backend != "local":
        raise NotImplementedError(f"runtime.backend={cfg.runtime.backend!r} is not implemented yet; "
                                  "use runtime.backend=local (rollout workers as local processes)")
    preset = cfg.algo.resolve()
    mode = preset.mode if cfg.runtime.mode == "auto" else cfg.runtime.mode
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    policy = load_policy(policy_spec, dtype=cfg.model.dtype, device=cfg.model.device, seed=cfg.seed)
    critic = build_critic(cfg, policy, preset, critic_spec)
    env_factory = make_env_factory(cfg.env.type, cfg.env.options)
    train_tasks, test_tasks = build_tasks(cfg, env_factory)
    r = cfg.rollout
    spec = WorkerSpec(policy=policy_spec, tokenizer=cfg.model.tokenizer, env_type=cfg.env.type,
                      env_options=dict(cfg.env.options), weights_dir=str(run_dir / "weights"),
                      sampling=sampling_params(cfg), engine_slots=r.engine_slots,
                      max_total_tokens=r.max_total_tokens, seed=cfg.seed, engine_kind=r.engine,
                      threads=cfg.runtime.worker_threads, device=cfg.model.device, dtype=cfg.model.dtype,
                      http_url=r.http_url)
    backend = LocalBackend(spec, r.num_workers, r.concurrent_episodes)

    def run_eval(model, progress: Progress) -> dict:
        if not test_tasks:
            return {}
        tasks = test_tasks[: cfg.run.eval_tasks]
        metrics, _ = evaluate(model, tokenizer, env_factory, tasks, max_new_tokens=r.max_new_tokens,
                              max_total_tokens=r.max_total_tokens, slots=r.engine_slots,
                              temperature=cfg.run.eval_temperature, progress=progress, seed=cfg.seed)
        return metrics

    def write_samples(directory: Path, step: int, trajs: list) -> None:
        from saorl.agent.render import render_trajectory

        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"step-{step:08d}.txt", "w", encoding="utf-8") as f:
            for t in trajs[:4]:
                versions = sorted(set(t.action_versions))
                f.write(f"=== task {t.task_id} reward {t.total_reward:.3f} versions {versions}\n")
                f.write(render_trajectory(t, tokenizer, color=False) + "\n\n")
        with open(directory / "samples.jsonl", "a", encoding="utf-8") as f:
            for t in trajs[:4]:
                f.write(json.dumps({"step": step, **t.to_dict()}) + "\n")

    def export_final(directory: Path, learner) -> None:
        export_policy(learner.policy, tokenizer, directory / "policy")
        if learner.critic is not None:
            save_critic(learner.critic, directory / "critic")

    return RunParts(preset, mode, tokenizer, policy, critic, env_factory, train_tasks, test_tasks, backend,
                    run_eval, write_samples, export_final)
