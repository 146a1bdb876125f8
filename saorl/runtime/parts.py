"""Building a run's parts from its config: models, env, task splits, backend, weights, learner.

Kept apart from the loop so that :mod:`saorl.runtime.run` reads as the algorithm and this file
as the wiring. The config is unpacked here, at the call sites; nothing the parts do reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from saorl.agent.prompts import fitting_for_run
from saorl.algo.registry import AlgoPreset
from saorl.config import SaorlConfig
from saorl.config.engines import LocalEngineConfig
from saorl.config.sections import LORA_TARGETS
from saorl.data.task import Task
from saorl.data.tasks import check_disjoint, held_out_seed, load_split
from saorl.engines.base import SamplingParams
from saorl.engines.clients.routes import RouteLayout
from saorl.engines.kinds import ClientOptions, server_kind, updated_in_place
from saorl.envs.registry import EnvFactory, env_factory_for, tool_options_for
from saorl.models.codec import RunTokenizer, check_vocab, run_tokenizer
from saorl.models.critic import Critic
from saorl.models.loading import checkpoint_activations, moe_layout, policy_source, train_dtype
from saorl.models.lora import lora_critic
from saorl.models.shelf import PolicyShelf
from saorl.run_paths import RunPaths
from saorl.runtime.backends.base import Backend
from saorl.runtime.backends.local import LocalBackend
from saorl.runtime.backends.worker import WorkerSpec, build_engine
from saorl.runtime.learner.single import Learner, OptimConfig
from saorl.runtime.weights.base import WeightPublisher, WeightSource
from saorl.runtime.weights.files import FilePublisher, FileSource

if TYPE_CHECKING:
    from saorl.runtime.weights.servers import ServerCheck


@dataclass
class RunParts:
    preset: AlgoPreset
    mode: Literal["async", "sync"]
    tokenizer: RunTokenizer
    policy: torch.nn.Module
    critic: Critic | None
    env_factory: EnvFactory
    """Fresh envs for the trainer's own episodes (evaluations; ``runtime.backend: inprocess``);
    close it at the end (:meth:`~saorl.envs.registry.EnvFactory.close`)."""
    train_tasks: list[Task]
    test_tasks: list[Task]
    backend: Backend
    weights: WeightPublisher


def build_tasks(cfg: SaorlConfig, env_factory, tokenizer=None) -> tuple[list[Task], list[Task]]:
    """The run's (train, test) task splits; an id in both is an error, never a silent overlap.
    With the run's ``tokenizer``, a task whose prompt cannot fit the token budget is left out (or
    stops the start) per ``env.overlong_prompts`` (:mod:`saorl.agent.prompts`)."""
    env = env_factory()
    train = load_split(env, cfg.env, "train", cfg.env.num_train_tasks, cfg.seed)
    test = load_split(env, cfg.env, "test", cfg.env.num_test_tasks, held_out_seed(cfg))
    if not train:
        raise ValueError(f"env {cfg.env.type!r} produced no training tasks")
    check_disjoint(train, test, "train split", "test split")
    if tokenizer is not None:
        train = fitting_for_run(cfg, train, env_factory, tokenizer, "training tasks")
        test = fitting_for_run(cfg, test, env_factory, tokenizer, "test tasks")
    return train, test


def build_critic(cfg: SaorlConfig, policy, preset: AlgoPreset, critic_spec: str | None) -> Critic | None:
    """None without a critic; a saved (value-pretrained) critic; a critic whose trunk is another
    model's (``model.critic`` naming a model: a directory, a ``.gguf`` file, a short name, a Hub
    id); else a copy of the policy's trunk."""
    if not preset.use_critic:
        return None
    if critic_spec:
        from saorl.models.serialize import load_critic
        from saorl.models.source import LOCAL_KINDS, parse

        p = next(policy.parameters())
        source = parse(critic_spec, "model.critic", LOCAL_KINDS)
        if source.kind == "critic":
            return lora_critic(cfg.model.lora, load_critic(critic_spec, device=p.device), cfg.seed)
        trunk = source.load_spec
        critic = Critic.from_policy(trunk, dtype=p.dtype, device=p.device, seed=cfg.seed)
        return lora_critic(cfg.model.lora, critic, cfg.seed)
    return lora_critic(cfg.model.lora, Critic.from_policy(policy, seed=cfg.seed), cfg.seed)


def lora_policy(cfg: SaorlConfig, policy, spec: str):
    """``policy`` as ``model.lora`` asks: itself, or wrapped in a LoRA adapter whose base is the
    policy ``spec`` loaded (:mod:`saorl.models.lora`). Called after the critic was copied from the
    plain policy: the critic gets its own adapter only with ``model.lora.critic`` (:func:`lora_critic`)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return policy
    from saorl.models.lora import attach_lora

    return attach_lora(policy, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                       targets=lora.target_modules, optional=LORA_TARGETS,
                       base={"policy": spec, "seed": cfg.seed}, seed=cfg.seed)


def build_learner(cfg: SaorlConfig, preset: AlgoPreset, policy, critic: Critic | None,
                  pad_id: int | None) -> Learner:
    """The learner of the algorithm ``preset`` (resolved from ``cfg``), ``cfg``'s trainer settings
    and sampler (for exact DIS ratios): in this process, or sharded over the ranks of a torchrun
    launch (``trainer.shard: fsdp2``; there the ranks other than 0 pass ``policy=None`` and
    ``pad_id=None`` and receive rank 0's)."""
    t, r = cfg.trainer, cfg.rollout
    optim = OptimConfig.from_trainer(t)
    sampler = {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p}
    if t.shard == "fsdp2":
        from saorl.runtime.learner import shard_group
        from saorl.runtime.learner.sharded import ShardedLearner

        group = shard_group.current()
        if group.rank == 0:  # the other ranks wait in shard_stages.serve_stages: the stages are over
            group.command("learner")
        return ShardedLearner(policy, critic, preset, optim, group=group,
                              pad_id=pad_id, bucket_mb=t.publish_bucket_mb,
                              checkpoint_format=t.shard_checkpoint,
                              activation_checkpointing=t.activation_checkpointing,
                              max_tokens_per_microbatch=t.max_tokens_per_microbatch, packing=t.packing,
                              shared_prefix=t.shared_prefix, **sampler)
    if t.activation_checkpointing:
        checkpoint_activations(policy, critic.trunk if critic is not None else None)
    return Learner(policy, critic, preset, optim, pad_id=pad_id, device=cfg.model.device,
                   max_tokens_per_microbatch=t.max_tokens_per_microbatch, packing=t.packing,
                   shared_prefix=t.shared_prefix, **sampler)


def worker_spec(cfg: SaorlConfig, run_dir: Path, policy_spec: str, tokenizer: RunTokenizer, *,
                preset: AlgoPreset | None = None) -> WorkerSpec:
    """What a rollout worker (a process or a Ray actor) builds its engine from: the policy's local
    directory (a Hub id is resolved here, once) and the run's tokenizer spec, so it loads exactly
    what the trainer did. ``preset``: the run's (None: ``cfg``'s)."""
    r = cfg.rollout
    local = policy_source(policy_spec)
    replay = (preset or cfg.algo.preset).routing_replay
    served = not isinstance(r.engine, LocalEngineConfig)
    layers, experts = moe_layout(local) if replay and served else (0, 0)
    layout = RouteLayout(layers, experts) if layers else None  # a dense policy: the learner refuses it
    engine = r.engine
    if isinstance(engine, LocalEngineConfig):
        engine = engine.model_copy(update={"dtype": engine.dtype or cfg.model.dtype})
    return WorkerSpec(policy=local, tokenizer=tokenizer.spec, env_type=cfg.env.type,
                      env_options=cfg.env.env_options, weights_dir=str(RunPaths(run_dir).weights),
                      sampling=SamplingParams.of_rollout(r), engine=engine,
                      max_total_tokens=r.max_total_tokens,
                      seed=cfg.seed, threads=cfg.runtime.worker_threads, device=cfg.model.device,
                      record_routes=replay, route_layout=layout, env_call_timeout_s=cfg.env.call_timeout_s,
                      env_observation_format=cfg.env.observation_format,
                      env_observation_role=cfg.env.observation_role, env_tools=tool_options_for(cfg.env))


def build_ray(cfg: SaorlConfig, run_dir: Path, policy_spec: str, tokenizer: RunTokenizer,
              weights: WeightPublisher, preset: AlgoPreset | None = None) -> tuple[Backend, WeightPublisher]:
    """The Ray backend and the publisher of the weights its workers follow: ``weights`` (files in
    the run directory), or with ``ray.weights: object_store`` Ray's object store; on the cluster of
    ``cfg.ray`` (joined or started here; stopped by the backend's shutdown)."""
    from saorl.runtime.backends.ray_actors import RayBackend, RayCluster

    cluster = RayCluster(cfg.ray)
    try:
        remote: WeightSource | None = None  # None: the workers read the files
        if cfg.ray.weights == "object_store":
            from saorl.runtime.weights.ray_store import ray_weights

            weights, remote = ray_weights()
        device = "cuda" if cfg.ray.worker_gpus else "cpu"  # Ray hands a worker its own GPUs
        spec = replace(worker_spec(cfg, run_dir, policy_spec, tokenizer, preset=preset), device=device)
        backend = RayBackend(spec, cfg.ray, cfg.rollout.num_workers, cfg.rollout.concurrent_episodes,
                             cluster, remote)
        return backend, weights
    except BaseException:
        cluster.stop()
        raise


def build_backend(cfg: SaorlConfig, run_dir: Path, policy_spec: str, tokenizer: RunTokenizer, env_factory,
                  weights: WeightSource, preset: AlgoPreset | None = None) -> Backend:
    """``runtime.backend``: worker processes (``local``) or episodes in this process (``inprocess``);
    ``ray`` is :func:`build_ray`."""
    r = cfg.rollout
    spec = worker_spec(cfg, run_dir, policy_spec, tokenizer, preset=preset)
    if cfg.runtime.backend == "inprocess":
        from saorl.runtime.backends.inprocess import InProcessBackend

        engine = build_engine(spec, tokenizer)
        return InProcessBackend(engine, env_factory, tokenizer, sampling=SamplingParams.of_rollout(r),
                                max_total_tokens=r.max_total_tokens,
                                concurrency=r.num_workers * r.concurrent_episodes, weights=weights,
                                owns_engine=True)
    return LocalBackend(spec, r.num_workers, r.concurrent_episodes, stall_s=cfg.runtime.worker_stall_s)


def build_weight_sync(cfg: SaorlConfig, run_dir: Path, policy, tokenizer,
                      preset: AlgoPreset | None = None) -> WeightPublisher:
    """Files in ``RUN/weights`` for the local engine and ``saorl serve``; for vLLM / SGLang also
    each version put on the servers in place and verified there (:mod:`saorl.runtime.weights.servers`)."""
    files = FilePublisher(RunPaths(run_dir).weights)
    e = cfg.rollout.engine
    if not updated_in_place(e.kind):
        return files
    from saorl.engines.clients.transport import HttpTransport
    from saorl.runtime.weights.servers import ServerPublisher

    check = server_check(cfg, tokenizer, preset)
    transport = HttpTransport(e.urls, timeout_s=e.weight_update_timeout_s)
    admins = [server_kind(e.kind).admin(u, transport, e) for u in e.urls]
    return ServerPublisher(files, admins, transport, policy, timeout_s=e.weight_update_timeout_s,
                           check=check)


def server_check(cfg: SaorlConfig, tokenizer, preset: AlgoPreset | None = None) -> ServerCheck:
    """The check that each server samples from the published weights, under ``cfg``'s sampling
    (and, with routing replay, scored with the experts the server routed each token to)."""
    from saorl.runtime.weights.servers import DEFAULT_TOLERANCE, ServerCheck, check_sampling

    e = cfg.rollout.engine
    kind = server_kind(e.kind)
    replay = (preset or cfg.algo.preset).routing_replay
    layout = RouteLayout(*moe_layout(policy_source(cfg.model.policy))) if replay else None
    options = ClientOptions(return_routes=replay, route_layout=layout)
    prompt = list(tokenizer.encode("The weight check compares the server with the trainer:"))
    tol = e.verify_tol if e.verify_tol is not None else DEFAULT_TOLERANCE[cfg.model.dtype]
    return ServerCheck(lambda url: kind.client(e.model_copy(update={"urls": [url]}), options), prompt,
                       check_sampling(SamplingParams.of_rollout(cfg.rollout), cfg.seed), tol,
                       kind.server_name,
                       every=e.verify_every, replay=replay)


def build_parts(cfg: SaorlConfig, preset: AlgoPreset, run_dir: Path, policy_spec: str,
                critic_spec: str | None, shelf: PolicyShelf | None = None) -> RunParts:
    """Everything a :class:`~saorl.runtime.run.Run` needs, starting from ``policy_spec`` (the SFT
    warm start or ``model.policy``) and ``critic_spec`` (a pretrained critic, or None), for the
    algorithm ``preset`` (resolved from ``cfg`` once, by the caller). The trainer's policy is taken
    from ``shelf`` when an earlier phase holds it there (:mod:`saorl.models.shelf`), else loaded."""
    shelf = shelf if shelf is not None else PolicyShelf()
    tokenizer = run_tokenizer(cfg.model)
    # sharded: the full models stay on the CPU; each rank's shards go to its device
    device = "cpu" if cfg.trainer.shard == "fsdp2" else cfg.model.device
    policy = shelf.take(policy_spec, dtype=train_dtype(cfg.model.dtype), device=device, seed=cfg.seed)
    check_vocab(tokenizer, policy)
    critic = build_critic(cfg, policy, preset, critic_spec)
    if critic is not None:
        check_vocab(tokenizer, critic.trunk, "critic")
    policy = lora_policy(cfg, policy, policy_spec)
    env_factory = env_factory_for(cfg.env)
    train_tasks, test_tasks = build_tasks(cfg, env_factory, tokenizer)
    weights = build_weight_sync(cfg, run_dir, policy, tokenizer, preset)
    try:
        if cfg.runtime.backend == "ray":
            backend, weights = build_ray(cfg, run_dir, policy_spec, tokenizer, weights, preset)
        else:
            backend = build_backend(cfg, run_dir, policy_spec, tokenizer, env_factory,
                                    FileSource(RunPaths(run_dir).weights), preset)
    except BaseException:
        weights.close()
        env_factory.close()
        raise
    return RunParts(preset, cfg.resolved_mode(preset), tokenizer, policy, critic, env_factory, train_tasks,
                    test_tasks, backend, weights)
