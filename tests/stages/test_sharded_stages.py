"""SFT and value pretraining's fit on 2 gloo ranks equal the single-process ones.

Rank 0 runs SFT and a fit through :func:`~saorl.runtime.learner.shard_stages.run_sharded` as a sharded
run's stages do; rank 1 serves them (:func:`~saorl.runtime.learner.shard_stages.serve_stages`). The
single-process stage runs on the same data in this process. Tolerances as in
tests/runtime/learner/test_sharded.py: the last loss within 1e-5 relative, every weight within 1e-6 after
the steps at lr 1e-5 (Adam turns another summation order into weight differences that scale with
the learning rate).
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from saorl.algo.registry import get_preset
from saorl.data.trajectory import Trajectory
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny

SFT = dict(steps=3, batch_size=5, lr=1e-5, seed=0, warmup_steps=1, max_tokens_per_microbatch=30,
           packing=True)
FIT = dict(steps=3, batch_size=5, lr=1e-5, grad_clip=1.0, pad_id=1, seed=0, device="cpu",
           max_tokens_per_microbatch=30, packing=True)


def _trajs(n: int = 9) -> list[Trajectory]:
    """Trajectories of different lengths (uneven shares): prompt, action, observation, action."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        parts = [rng.randint(2, 6), rng.randint(2, 5), rng.randint(1, 4), rng.randint(1, 3)]
        ids = [rng.randint(2, 999) for _ in range(sum(parts))]
        mask = [0] * parts[0] + [1] * parts[1] + [0] * parts[2] + [1] * parts[3]
        rewards = [0.0] * (len(ids) - 1) + [float(rng.random() < 0.5)]
        out.append(Trajectory(ids, mask, [0.0] * len(ids), rewards, [0 if m else -1 for m in mask],
                              parts[0]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models():
    policy = build_tiny("tiny-dense", seed=0)
    return policy, Critic.from_policy(policy, seed=0)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from saorl.runtime.learner import shard_group
    from saorl.runtime.learner.shard_stages import run_sharded, serve_stages
    from saorl.stages.sft import sft
    from saorl.stages.value_pretrain import fit_critic

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = shard_group.join("cpu")
    try:
        if rank != 0:
            serve_stages(group)
            return
        policy, critic = _models()
        trained, sft_m = run_sharded(sft, policy, _trajs(), 1, which="policy", **SFT)
        torch.save({k: v.clone() for k, v in trained.state_dict().items()}, f"{out}/sft.pt")
        fitted, fit_m = run_sharded(fit_critic, critic, _trajs(), get_preset("sao"), which="critic", **FIT)
        torch.save({k: v.clone() for k, v in fitted.state_dict().items()}, f"{out}/critic.pt")
        Path(out, "metrics.json").write_text(json.dumps({"sft": sft_m, "fit": fit_m}))
        group.command("close")
    finally:
        shard_group.leave()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("stages")
    mp.spawn(_rank, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return out


def _assert_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)


def test_sharded_sft_equals_single_process_sft(sharded):
    from saorl.stages.sft import sft

    policy, _ = _models()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    single = sft(policy, _trajs(), 1, **SFT)
    got = json.loads((sharded / "metrics.json").read_text())["sft"]
    assert got["sft/loss"] == pytest.approx(single["sft/loss"], rel=1e-5)
    assert got["sft/nonfinite_skips"] == single["sft/nonfinite_skips"] == 0
    state = torch.load(sharded / "sft.pt")
    _assert_weights(state, dict(policy.state_dict()))
    assert any(not torch.equal(state[k], before[k]) for k in before)  # it trained


def test_sharded_value_fit_equals_single_process_fit(sharded):
    from saorl.stages.value_pretrain import fit_critic

    _, critic = _models()
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    single = fit_critic(critic, _trajs(), get_preset("sao"), **FIT)
    got = json.loads((sharded / "metrics.json").read_text())["fit"]
    assert got["critic/value_loss"] == pytest.approx(single["critic/value_loss"], rel=1e-5)
    state = torch.load(sharded / "critic.pt")
    _assert_weights(state, dict(critic.state_dict()))
    changed = {k for k in before if not torch.equal(state[k], before[k])}
    assert "value_head.weight" in changed and not any("self_attn" in k for k in changed)  # frozen attention


@pytest.mark.slow
def test_a_torchrun_run_warm_starts_and_pretrains_its_critic_on_every_rank(tmp_path):
    """``torchrun --nproc-per-node 2 saorl train trainer.shard=fsdp2`` with SFT and value
    pretraining on: both stages finish (rank 1 served their steps), the run trains, and the cached
    warm start and critic load with plain transformers / saorl."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from saorl.models.serialize import load_critic

    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "saorl.cli", "train", "trainer.shard=fsdp2", "runtime.backend=inprocess",
           f"run.out_dir={out}", "model.policy=tiny-dense",
           "sft.steps=6", "sft.num_demos=16", "sft.batch_size=8", "value_pretrain.rollouts=8",
           "value_pretrain.steps=3", "value_pretrain.batch_size=4", "trainer.steps=2", "trainer.batch_size=4",
           "env.num_test_tasks=4", "run.eval_tasks=2", "run.eval_every=1000", "run.progress=false",
           "rollout.concurrent_episodes=4", "rollout.engine.slots=4", "rollout.max_new_tokens=12",
           "rollout.max_total_tokens=80", "--run-dir", str(tmp_path / "run")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (sft_dir,) = (out / ".cache").glob("sft-*")
    (critic_dir,) = (out / ".cache").glob("critic-*")
    sft_m = json.loads((sft_dir / "sft_metrics.json").read_text())
    assert sft_m["sft/nonfinite_skips"] == 0 and sft_m["sft/loss"] > 0
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(sft_dir)).parameters()) > 0
    assert load_critic(str(critic_dir)) is not None
    curve = json.loads((critic_dir / "value_pretrain_metrics.json").read_text())["curve"]
    assert [r["rollouts"] for r in curve][1:] == sorted({r["rollouts"] for r in curve[1:]})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["policy/version"] == 2
