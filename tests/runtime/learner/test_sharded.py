"""The sharded (FSDP2) learner: one step on 2 gloo ranks equals one single-process step.

One launch of 2 ranks (``shard_helpers.launch``) plays every case, then each test compares what
rank 0 wrote with a single-process :class:`~saorl.runtime.learner.single.Learner` on the same batch.

Tolerances: losses and metrics within 1e-5 relative; every parameter within 1e-6 after the step.
A metric that is a mean of signed values near 0 (``critic/value_mean`` of an untrained critic,
about 1e-4, a mean of values of about 1e-2) is compared within 1e-7 absolute instead: float32
summation in another order (another cut into micro-batches) moves it by a few 1e-9, measured
4e-9, which is 3e-5 of it.
Adam's first step moves an element by lr · g / (|g| + eps), which amplifies the float rounding of
g (different summation orders on 1 and 2 ranks) for elements whose |g| is near eps, so the
parameters' agreement scales with the learning rate: measured 1.2e-6 at lr 1e-4, up to 6.4e-7 at the 1e-5
used here, where every element moves by about 1e-5. A gradient scale error would not show in the
parameters after one Adam step (Adam divides it out); the gradient norm, compared as a metric,
shows it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from shard_helpers import CASES, LAYOUT, OPTIM, PAD, case, launch, layout, models

from saorl.algo.registry import get_preset
from saorl.data.batch import collate
from saorl.data.packing import MicroBatch, microbatches
from saorl.models.hf_format import INDEX, read_weights
from saorl.runtime.learner.sharded import _by_index, _by_name, split_groups
from saorl.runtime.learner.single import Learner


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    launch(out)
    return out


def single(name: str, seed: int = 0, device: str = "cpu", **overrides):
    """The single-process learner of case ``name`` (its preset with ``overrides``) after one step
    on the same batch, its metrics and the weights before the step (the case's micro-batch layout,
    as each rank cuts its share). Cached: the tests only read what it returns."""
    return _single(name, seed, device, tuple(sorted(overrides.items())))


@functools.cache
def _single(name: str, seed: int, device: str, overrides: tuple):
    policy, critic, preset, trajs, gids = case(name, seed=seed)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    policy, critic = policy.to(device), critic.to(device) if critic is not None else None
    learner = Learner(policy, critic, preset.with_overrides(**dict(overrides)), OPTIM, pad_id=PAD,
                      device=device, **layout(name))
    return learner, learner.step(trajs, gids), before


def _close(a: float, b: float, rel: float = 1e-5, tiny: float = 1e-7) -> bool:
    """Within ``rel``, or within ``tiny`` of each other (see the module docstring)."""
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= max(rel * max(abs(a), abs(b)), tiny)


def check_step(out, name: str, device: str = "cpu") -> None:
    """What the ranks wrote for case ``name`` equals one single-process step (module docstring)."""
    learner, metrics, before = single(name, device=device)
    got = json.loads((out / f"{name}.json").read_text())
    assert set(got) == set(metrics)
    for key, value in metrics.items():
        if key.startswith("throughput/"):  # how the work was cut: per rank here (see the micro-batch test)
            continue
        if isinstance(value, list):  # the ratio histogram: the same counts
            assert got[key] == value, key
        else:
            assert _close(float(got[key]), float(value)), (key, got[key], value)
    assert "critic/value_loss" in got or learner.critic is None
    policy = load_file(str(out / f"{name}_policy.safetensors"))
    after = {k: v.cpu() for k, v in learner.policy.state_dict().items()}
    for k, v in after.items():
        assert (policy[k] - v).abs().max() <= 1e-6, k
    moved = [k for k, v in after.items() if (v - before[k]).abs().max() > 1e-6]
    assert len(moved) > 10, "the step should move most policy parameters"
    if learner.critic is not None:
        critic = load_file(str(out / f"{name}_critic.safetensors"))
        for k, v in learner.critic.state_dict().items():
            assert (critic[k] - v.cpu()).abs().max() <= 1e-6, k


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_one_sharded_step_equals_one_single_process_step(sharded, name):
    check_step(sharded, name)


def rank_microbatches(name: str) -> list[list[MicroBatch]]:
    """The micro-batches each of the 2 ranks cuts its share of case ``name`` into."""
    _, _, _, trajs, gids = case(name)
    shares = split_groups(gids, [len(t) for t in trajs], 2)
    budget, packing = LAYOUT[name]
    return [microbatches(collate([trajs[i] for i in s], PAD), budget, packing) if s else [] for s in shares]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_sharded_micro_batches_accumulate_to_the_single_process_step(sharded, name):
    """Each rank cuts its share into several micro-batches (some of several trajectories),
    unequally many on the two ranks (the fewer run idle passes); the step still equals the
    single-process one (``check_step``), and the throughput metrics count every rank's
    micro-batches and positions."""
    micro = rank_microbatches(name)
    counts = sorted(len(m) for m in micro)
    assert counts[0] >= 2 and counts[0] != counts[1], counts
    assert max(len(mb.rows) for m in micro for mb in m) >= 2
    got = json.loads((sharded / f"{name}.json").read_text())
    assert got["throughput/microbatches"] == sum(counts)
    _, _, _, trajs, _ = case(name)
    actions = sum(sum(t.action_mask) for t in trajs)
    positions = sum(mb.positions for m in micro for mb in m)
    assert got["throughput/positions_per_action_token"] == pytest.approx(positions / actions, rel=1e-12)


@pytest.mark.slow
def test_routing_replay_is_replayed_on_the_ranks(sharded):
    """The replay case equals the single-process learner *with* replay (``check_step``) and differs
    from one without it: the engine's routes reached the ranks' forwards."""
    _, replayed, _ = single("mb_moe_replay")
    _, natural, _ = single("mb_moe_replay", routing_replay=False)
    got = json.loads((sharded / "mb_moe_replay.json").read_text())
    assert got["policy/loss"] == pytest.approx(replayed["policy/loss"], rel=1e-5)
    assert abs(natural["policy/loss"] - replayed["policy/loss"]) > 1e-3 * abs(replayed["policy/loss"])


@pytest.mark.slow
def test_bucketed_publication_is_save_pretrained_in_buckets(sharded, tmp_path):
    learner, _, _ = single("moe_sao")
    learner.policy.save_pretrained(str(tmp_path / "hf"))
    expected = load_file(str(tmp_path / "hf" / "model.safetensors"))
    version = sharded / "published" / "v00000001"
    index = json.loads((version / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    published = {}
    for f in files:
        part = load_file(str(version / f))
        assert set(part) == {k for k, v in index["weight_map"].items() if v == f}
        published |= part
    # per-expert names, and the tied LM head that save_pretrained drops: a server reloads only
    # what the checkpoint carries (docs/engines.md)
    assert set(published) == set(expected) | {"lm_head.weight"}
    assert torch.equal(published["lm_head.weight"], published["model.embed_tokens.weight"])
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in published)
    for k, v in expected.items():
        assert (published[k] - v).abs().max() <= 1e-6, k
    # what a rollout worker's engine loads from it: the model's own (fused) names back
    back = read_weights(str(version), like=learner.policy)
    for k, v in learner.policy.state_dict().items():
        assert (back[k] - v).abs().max() <= 1e-6, k


@pytest.mark.slow
def test_sharded_learner_resumes_from_sharded_and_full_checkpoints_and_single_from_full(sharded):
    trained_policy = load_file(str(sharded / "moe_sao_policy.safetensors"))
    trained_critic = load_file(str(sharded / "moe_sao_critic.safetensors"))
    for fmt in ("sharded", "full"):  # fresh learners (other initial weights) on 2 ranks
        policy = load_file(str(sharded / f"resumed_{fmt}_policy.safetensors"))
        critic = load_file(str(sharded / f"resumed_{fmt}_critic.safetensors"))
        assert all(torch.equal(policy[k], v) for k, v in trained_policy.items()), fmt
        assert all(torch.equal(critic[k], v) for k, v in trained_critic.items()), fmt
    # the full layout is the single-process one: a single-process learner resumes from it,
    # optimizer states included (Adam's moments by parameter index)
    reference, _, _ = single("moe_sao")
    policy, critic = models("tiny-moe", "sao", seed=1)
    resumed = Learner(policy, critic, get_preset("sao"), OPTIM, pad_id=PAD)
    resumed.load_state(sharded / "full", json.loads((sharded / "full" / "manifest.json").read_text()))
    assert all(torch.equal(v, trained_policy[k]) for k, v in policy.state_dict().items())
    for opt, ref in ((resumed.policy_opt, reference.policy_opt), (resumed.critic_opt, reference.critic_opt)):
        a, b = opt.state_dict(), ref.state_dict()
        assert set(a["state"]) == set(b["state"])
        for i, s in b["state"].items():
            assert torch.equal(a["state"][i]["step"], s["step"])
            assert (a["state"][i]["exp_avg"] - s["exp_avg"]).abs().max() <= 1e-6


@pytest.mark.slow
def test_an_update_non_finite_on_one_rank_is_rolled_back_on_every_rank(sharded):
    """Rank 0 stepped with an infinite learning rate (its shards overflow, rank 1's do not): the
    full policy afterwards is exactly the one before that step, which counts as skipped."""
    assert json.loads((sharded / "rollback.json").read_text()) == {"train/nonfinite_skips": 1,
                                                                   "policy/version": 1}
    before = load_file(str(sharded / "moe_sao_policy.safetensors"))
    after = load_file(str(sharded / "rollback_policy.safetensors"))
    assert set(after) == set(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_shares_keep_groups_whole_and_balance_tokens():
    gids = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    lengths = [10] * 4 + [30] * 4 + [20] * 4
    shares = split_groups(gids, lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(12))
    for s in shares:
        assert all(sum(gids[i] == g for i in s) in (0, 4) for g in (0, 1, 2))  # whole groups
    assert sorted(sum(lengths[i] for i in s) for s in shares) == [120, 120]
    assert split_groups([0, 0, 0, 0], [5] * 4, 2) == [[0, 1, 2, 3], []]  # one group: one rank idle
    assert split_groups([0, 1, 2], [3, 9, 5], 2) == [[1], [0, 2]]


def test_optimizer_state_by_name_and_by_index_are_inverse():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # frozen: not in the optimizer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    by_index = opt.state_dict()
    by_name = _by_name(by_index, model)
    assert set(by_name["state"]) == {"0.weight", "1.weight", "1.bias"}
    assert by_name["param_groups"][0]["params"] == ["0.weight", "1.weight", "1.bias"]
    again = _by_index(by_name, model)
    assert again["param_groups"] == by_index["param_groups"]
    assert all(torch.equal(again["state"][i]["exp_avg"], s["exp_avg"]) for i, s in by_index["state"].items())


def test_sharding_outside_torchrun_is_one_clear_error(monkeypatch):
    from saorl.runtime.learner import shard_group

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(shard_group.ShardError, match="torchrun --standalone --nproc-per-node"):
        shard_group.join("cpu")


_RANK_SCRIPT = """
import atexit, sys
from saorl import cli
from saorl.runtime.learner import shard_group
atexit.register(lambda: print("TEARDOWN RAN", flush=True))
if sys.argv[1] == "join":
    shard_group.join("cpu")
    shard_group.leave()
print("before main", end=" ")  # unflushed: main must flush it before it leaves
cli.main(["config", "trainer.steps=7"] if sys.argv[2] == "ok" else ["config", "trainer.steps=-1"])
print("AFTER MAIN", flush=True)
"""


@pytest.mark.parametrize("mode, status", [("join", 0), ("join", 2), ("plain", 0)])
def test_a_sharded_rank_process_ends_in_main_without_the_interpreter_teardown(tmp_path, mode, status):
    """torch's C++ teardown after a gloo group aborted finished two-rank runs (SIGABRT, 'terminate
    called without an active exception'): a process that joined the ranks leaves from cli.main
    with its status, its output flushed and no teardown (atexit) run; other processes return."""
    from shard_helpers import free_port

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    res = subprocess.run([sys.executable, "-c", _RANK_SCRIPT, mode, "ok" if status == 0 else "bad"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == (status if mode == "join" else 0), res.stderr[-2000:]
    assert res.stdout.startswith("before main")
    assert ("steps: 7" in res.stdout) == (status == 0)
    ends_in_main = mode == "join"
    assert ("AFTER MAIN" in res.stdout) != ends_in_main and ("TEARDOWN RAN" in res.stdout) != ends_in_main


@pytest.mark.slow
def test_torchrun_two_ranks_three_steps_then_resume(tmp_path):
    """``torchrun --nproc-per-node 2`` end to end (full checkpoints), then ``--resume`` (which
    writes sharded ones): every trajectory trained once, an exported policy that loads."""
    from runtime_helpers import BASE, read_jsonl
    from transformers import AutoModelForCausalLM

    from saorl.runtime.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "saorl.cli", "train"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = subprocess.run([*torchrun, *BASE, "runtime.backend=inprocess", "trainer.shard=fsdp2",
                            "trainer.shard_checkpoint=full", "trainer.steps=3", "--run-dir", str(run_dir)],
                           capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert (ckpt / "policy.safetensors").is_file()  # the full layout
    resumed = subprocess.run([*torchrun, "--resume", str(run_dir), "trainer.steps=5",
                              "trainer.shard_checkpoint=sharded"],
                             capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert (latest_checkpoint(run_dir / "checkpoints") / "shards").is_dir()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "resume" not in r]  # (the resume's marker)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # step 0: the evaluation before training
    assert rows[-1]["policy/version"] == 5
    rids = [rid for r in read_jsonl(run_dir / "trained.jsonl") if "rids" in r for rid in r["rids"]]
    assert len(rids) == len(set(rids)) == 20
    published = json.loads((run_dir / "weights" / "latest.json").read_text())
    assert published["version"] == 5 and (run_dir / "weights" / published["file"] / INDEX).is_file()
    policy = AutoModelForCausalLM.from_pretrained(str(run_dir / "final" / "policy"))
    assert sum(p.numel() for p in policy.parameters()) > 0


def test_a_sharded_checkpoint_refuses_a_single_process_resume_in_one_paragraph(tmp_path):
    from saorl.runtime.learner.state_files import SHARDS, load_learner_files

    (tmp_path / SHARDS).mkdir()
    with pytest.raises(ValueError, match=r"trainer\.shard=fsdp2 under torchrun") as info:
        load_learner_files(tmp_path, {})
    assert "\n" not in str(info.value)


def test_every_rank_takes_rank_0s_version_as_a_resume_moved_it(sharded):
    """The trajectories were sampled at version 0; rank 0's version moved to 7 (a resume past the
    versions published before a crash): the whole batch is 7 versions stale, on both ranks' shares."""
    bumped = json.loads((sharded / "bumped.json").read_text())
    assert bumped.get("mismatch/tokens_s4_7", 0) > 0, bumped
    assert not any(v for k, v in bumped.items() if k != "mismatch/tokens_s4_7"), bumped
