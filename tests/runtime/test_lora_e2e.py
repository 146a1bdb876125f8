"""``saorl train`` with ``model.lora.rank=8`` end to end: in process (sync, so the engine/trainer
gap of every token is measured at staleness 0), with worker processes (async) and a resume, and
what the run leaves: adapters in RUN/weights and the checkpoints, a merged final/policy that plain
transformers loads, final/adapter, and ``saorl eval`` on each."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import BASE
from runtime_helpers import SYNC_MISMATCH_BASE as SYNC
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")

from saorl.cli import main
from saorl.commands.eval import resolve_target
from saorl.config import load_config
from saorl.data.jsonl import read_jsonl
from saorl.models.logprobs import token_logprobs
from saorl.training import train

IDS = torch.tensor([[5, 17, 230, 41, 99, 3, 64, 812, 7, 15, 400, 22]])


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, IDS, torch.ones_like(IDS))


def _steps(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) > 0]


@pytest.mark.slow
def test_an_inprocess_lora_run_samples_from_base_plus_adapter_and_exports_both(tmp_path):
    cfg = load_config(None, [*SYNC, f"run.out_dir={tmp_path}", "model.lora.rank=8", "run.checkpoint_every=1",
                             "trainer.policy_lr=1e-2"])
    run_dir, _ = train(cfg, tmp_path / "run")
    rows = _steps(run_dir)
    assert len(rows) == 2
    # step 2 sampled with the adapter of version 1 (B no longer zero) and scored it as the engine did
    assert max(r["mismatch/kl_s0"] for r in rows) < 1e-5
    published = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name != "latest.json")
    assert published and all(n.endswith("-adapter") for n in published)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    saved = load_file(str(ckpt / "policy.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert json.loads((ckpt / "manifest.json").read_text())["policy_weights"] == "lora_adapter"
    assert any(v.abs().sum() > 0 for k, v in saved.items() if ".lora_B." in k)  # it trained

    plain = AutoModelForCausalLM.from_pretrained(str(run_dir / "final" / "policy"), local_files_only=True)
    expected = _logprobs(plain.eval())
    assert {"adapter_config.json", "adapter_model.safetensors", "saorl_base.json"} <= {
        p.name for p in (run_dir / "final" / "adapter").iterdir()}
    for target in (run_dir / "final" / "adapter", ckpt, run_dir):  # what `saorl eval` loads
        model = resolve_target(str(target), []).load()
        assert not hasattr(model, "peft_config")
        assert (_logprobs(model) - expected).abs().max() < 1e-5, target
    base = resolve_target("tiny-moe", []).load()  # the adapter is not a no-op
    assert (_logprobs(base) - expected).abs().max() > 1e-3
    # `saorl replay` from the step-1 checkpoint (its adapter on the base) reproduces step 2
    out = tmp_path / "replay"
    assert main(["replay", str(run_dir), "--from-step", "1", "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]
    assert row["step"] == 2
    for k in ("policy/loss", "mismatch/kl", "policy/grad_norm", "critic/value_loss"):
        assert row["replay"][k] == pytest.approx(row["original"][k], rel=1e-6, abs=1e-9), k


@pytest.mark.slow
def test_routing_replay_with_a_lora_policy_brings_the_routing_mismatch_to_zero(tmp_path):
    knobs = ["model.lora.rank=8", "rollout.engine.moe_top_k=3", "rollout.engine.router_noise=0.5",
             "algo.routing_replay=true"]
    cfg = load_config(None, [*SYNC, f"run.out_dir={tmp_path}", *knobs])
    run_dir, _ = train(cfg, tmp_path / "run")
    assert max(r["mismatch/kl_s0"] for r in _steps(run_dir)) < 1e-6


@pytest.mark.slow
def test_an_async_lora_run_with_worker_processes_trains_checkpoints_and_resumes(tmp_path):
    over = [*BASE, f"run.out_dir={tmp_path}", "model.policy=tiny-dense", "model.lora.rank=8",
            "model.lora.target_modules=[q_proj,v_proj]", "run.checkpoint_every=2", "trainer.steps=2"]
    cfg = load_config(None, over)
    assert cfg.resolved_mode() == "async" and cfg.runtime.backend == "local"
    run_dir, metrics = train(cfg, tmp_path / "run")
    assert metrics["policy/version"] == 2
    adapter = json.loads((run_dir / "final" / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"] and adapter["r"] == 8
    cfg = load_config(run_dir / "config.yaml", ["trainer.steps=3"])
    _, metrics = train(cfg, run_dir, resume=True)
    assert metrics["policy/version"] == 3 and metrics["train/nonfinite_skips"] == 0
    assert [r["step"] for r in _steps(run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_a_lora_critic_run_value_pretrains_checkpoints_resumes_and_exports_a_plain_critic(tmp_path):
    from saorl.models.serialize import load_critic

    over = [*SYNC, f"run.out_dir={tmp_path}", "model.policy=tiny-dense", "model.lora.rank=8",
            "model.lora.critic=true", "run.checkpoint_every=1", "value_pretrain.enabled=true",
            "value_pretrain.rollouts=8", "value_pretrain.steps=2", "value_pretrain.batch_size=4"]
    run_dir, _ = train(load_config(None, over), tmp_path / "run")
    (pretrained,) = (tmp_path / ".cache").glob("critic-*")
    start = load_file(str(pretrained / "critic.safetensors"))
    assert not any("lora_" in k for k in start)  # value pretraining saved it merged, in the plain layout
    saved = load_file(str(run_dir / "checkpoints" / "step-00000002" / "critic.safetensors"))
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in saved.items())  # the RL adapter trained
    # under the adapter the trunk is the value-pretrained one, bit for bit (frozen); the head trained
    for k, v in saved.items():
        if "lora_" not in k and not k.startswith("value_head."):
            assert torch.equal(v, start[k.replace(".base_layer.", ".")]), k
    assert not torch.equal(saved["value_head.weight"], start["value_head.weight"])
    final = load_critic(run_dir / "final" / "critic")
    assert not final.lora and not any("lora_" in n for n, _ in final.named_parameters())
    cfg = load_config(run_dir / "config.yaml", ["trainer.steps=3"])
    _, metrics = train(cfg, run_dir, resume=True)
    assert metrics["policy/version"] == 3 and metrics["train/nonfinite_skips"] == 0
    assert [r["step"] for r in _steps(run_dir)] == [1, 2, 3]
