"""Two trainer ranks in spawned processes (gloo), for the sharded-learner tests.

:func:`launch` starts ``world`` processes that join a process group as torchrun's would and run
:func:`rank_main`: rank 0 drives a :class:`~saorl.runtime.learner.sharded.ShardedLearner` through the
cases and writes what it saw to ``out``; the other ranks serve it (``follow``).
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from saorl.algo.registry import get_preset
from saorl.data.batch import collate
from saorl.data.trajectory import Episode, Trajectory
from saorl.models.critic import Critic
from saorl.models.logprobs import token_logprobs
from saorl.models.routing import routers
from saorl.models.serialize import save_safetensors_atomic
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import OptimConfig

PAD = 1
OPTIM = OptimConfig(policy_lr=1e-5, critic_lr=1e-5)
# (name, model kind, preset, trajectories, group size): uneven shares, a rank with no share
# (one GRPO group of 4 on 2 ranks), the running-mean baseline over every rank's scores
CASES = [("moe_sao", "tiny-moe", "sao", 5, 1), ("dense_sao", "tiny-dense", "sao", 3, 1),
         ("dense_grpo", "tiny-dense", "grpo", 4, 4), ("dense_rm", "tiny-dense", "reinforce_rm", 4, 1),
         ("mb_dense_sao_packed", "tiny-dense", "sao", 9, 1),
         ("mb_dense_sao_padded", "tiny-dense", "sao", 9, 1),
         ("mb_dense_grpo_packed", "tiny-dense", "grpo", 12, 4),
         ("mb_dense_grpo_padded", "tiny-dense", "grpo", 12, 4),
         ("mb_moe_replay", "tiny-moe", "sao", 6, 1)]
# each case's micro-batches (trainer.max_tokens_per_microbatch, trainer.packing): one padded pass
# per rank, or budgets that cut every rank's share into several (and unequally many) micro-batches
LAYOUT = {"mb_dense_sao_packed": (36, True), "mb_dense_sao_padded": (40, False),
          "mb_dense_grpo_packed": (40, True), "mb_dense_grpo_padded": (40, False),
          "mb_moe_replay": (34, True)}
REPLAY = {"mb_moe_replay"}
"""Cases whose trajectories carry engine routes that the policy replays (``routing_replay``)."""


def layout(name: str) -> dict:
    budget, packing = LAYOUT.get(name, (10**9, False))
    return {"max_tokens_per_microbatch": budget, "packing": packing}


def preset_of(name: str, preset: str):
    return get_preset(preset).with_overrides(routing_replay=True) if name in REPLAY else get_preset(preset)


def with_routes(trajs: list[Trajectory], policy, seed: int = 0) -> list[Trajectory]:
    """``trajs`` with random engine routes (distinct experts per layer; -1, "route as usual", on
    every fifth token), other than the policy's own routing, so that replaying them matters."""
    gates = routers(policy)
    rng = random.Random(seed)
    layers, k, experts = len(gates), gates[0].top_k, gates[0].num_experts
    out = []
    for t in trajs:
        routes = [[-1] * (layers * k) if j % 5 == 4 else
                  [e for _ in range(layers) for e in rng.sample(range(experts), k)] for j in range(len(t))]
        out.append(replace(t, routes=routes))
    return out


def case(name: str, seed: int = 0):
    """Case ``name``'s models (``seed``), preset, trajectories and group ids."""
    _, kind, preset, n, g = next(c for c in CASES if c[0] == name)
    policy, critic = models(kind, preset, seed=seed)
    trajs, gids = trajectories(policy, n, g)
    if name in REPLAY:
        trajs = with_routes(trajs, policy)
    return policy, critic, preset_of(name, preset), trajs, gids


def trajectories(policy, n: int, group: int, seed: int = 0) -> tuple[list[Trajectory], list[int]]:
    """Multi-turn trajectories whose rollout log-probs are the policy's own plus noise (so that
    DIS keeps most tokens, masks a few), with varied lengths and rewards; and their group ids."""
    rng = random.Random(seed)
    raw = []
    for _ in range(n):
        p, a1, o, a2 = rng.randint(3, 6), rng.randint(2, 6), rng.randint(2, 4), rng.randint(2, 8)
        ids = [rng.randint(2, 1000) for _ in range(p + a1 + o + a2)]
        mask = [0] * p + [1] * a1 + [0] * o + [1] * a2
        rewards = [0.0] * len(ids)
        rewards[-1] = float(rng.random() < 0.5)
        raw.append((ids, mask, rewards, p))
    b = collate([Trajectory(ids, m, [0.0] * len(ids), r, [0 if x else -1 for x in m], p)
                 for ids, m, r, p in raw], PAD)
    with torch.no_grad():
        lp = token_logprobs(policy, b.input_ids, b.attention_mask)
    out = []
    for i, (ids, mask, rewards, p) in enumerate(raw):
        lps = [min(0.0, float(lp[i, j]) + rng.gauss(0, 0.3)) if m else 0.0 for j, m in enumerate(mask)]
        out.append(Trajectory(ids, mask, lps, rewards, [0 if m else -1 for m in mask], p, task_id=f"t{i}",
                              episode=Episode(success=rewards[-1] > 0)))
    return out, [i // group for i in range(n)]


def models(kind: str, preset: str, seed: int = 0):
    policy = build_tiny(kind, seed=seed).train()
    critic = Critic.from_policy(policy, seed=seed) if get_preset(preset).use_critic else None
    return policy, critic


def _save(path: Path, module) -> None:
    save_safetensors_atomic(module.state_dict(), path)


def _drive(group, out: Path, cases: list[tuple]) -> None:
    """Rank 0: every case's step; for the MoE also publication and checkpoints both ways."""
    from saorl.runtime.learner.sharded import ShardedLearner
    from saorl.runtime.weights.files import FilePublisher

    for name, kind, preset, _n, _g in cases:
        policy, critic, algo, trajs, gids = case(name)
        learner = ShardedLearner(policy, critic, algo, OPTIM, group=group, pad_id=PAD,
                                 bucket_mb=0.2, checkpoint_format="sharded", **layout(name))
        metrics = learner.step(trajs, gids)
        (out / f"{name}.json").write_text(json.dumps(metrics))
        full_policy, full_critic = learner.full_models()
        _save(out / f"{name}_policy.safetensors", full_policy)
        if full_critic is not None:
            _save(out / f"{name}_critic.safetensors", full_critic)
        if name == "moe_sao":
            learner.publish(FilePublisher(out / "published"))
            for fmt in ("sharded", "full"):
                learner.checkpoint_format = fmt
                meta = learner.save_state(out / fmt)
                (out / fmt / "manifest.json").write_text(json.dumps(
                    meta | {"version": learner.version, "learner_steps": learner.steps_done,
                            "nonfinite_skips": 0, "baseline": learner.baseline.state_dict()}))
            # an update that overflows rank 0's shards only (its own learning rate): every rank rolls back
            optim, learner.optim = learner.optim, replace(learner.optim, policy_lr=math.inf)
            m = learner.step(trajs, gids)
            (out / "rollback.json").write_text(json.dumps({k: m[k] for k in ("train/nonfinite_skips",
                                                                               "policy/version")}))
            _save(out / "rollback_policy.safetensors", learner.full_models()[0])
            # a resume moves rank 0's version past the published ones: every rank's share is that stale
            learner.optim, learner.version = optim, learner.version + 5
            m = learner.step(trajs, gids)
            (out / "bumped.json").write_text(json.dumps({k: v for k, v in m.items() if "tokens_s" in k}))
        learner.close()
        if name == "moe_sao":
            for fmt in ("sharded", "full"):  # a fresh learner (other weights) resumes each
                fresh = ShardedLearner(*models(kind, preset, seed=1), get_preset(preset), OPTIM, group=group,
                                       pad_id=PAD)
                fresh.load_state(out / fmt, json.loads((out / fmt / "manifest.json").read_text()))
                p, c = fresh.full_models()
                _save(out / f"resumed_{fmt}_policy.safetensors", p)
                _save(out / f"resumed_{fmt}_critic.safetensors", c)
                fresh.close()


def _follow(group, cases: list[tuple]) -> None:
    from saorl.runtime.learner.sharded import ShardedLearner

    for name, _kind, preset, _n, _g in cases:
        ShardedLearner(None, None, preset_of(name, preset), OPTIM, group=group, pad_id=PAD,
                       **layout(name)).follow()
        if name == "moe_sao":  # the two fresh learners that resume from the checkpoints
            for _ in range(2):
                ShardedLearner(None, None, get_preset(preset), OPTIM, group=group, pad_id=PAD).follow()


def rank_main(rank: int, world: int, port: int, out: str, device: str, names: list[str]) -> None:
    from saorl.runtime.learner import shard_group

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # on a GPU, compare float32 with float32
    torch.backends.cudnn.allow_tf32 = False
    cases = [c for c in CASES if c[0] in names]
    group = shard_group.join(device)
    try:
        if rank == 0:
            _drive(group, Path(out), cases)
        else:
            _follow(group, cases)
    finally:
        shard_group.leave()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, world: int = 2, device: str = "cpu", names: list[str] | None = None) -> None:
    """``world`` ranks on ``device`` (gloo on the CPU, NCCL on CUDA) playing the named cases."""
    names = names if names is not None else [c[0] for c in CASES]
    mp.spawn(rank_main, args=(world, free_port(), str(out), device, names), nprocs=world, join=True)
