"""Real model families from a local Hugging Face directory train as policy and critic: Qwen3,
Qwen3-MoE and Llama (small random-init models with their own tokenizers, ``model_families``),
each through ``saorl train``'s own path for 3 SAO steps, exported, and reloaded with
``AutoModelForCausalLM``. Between them they cover float32 and bfloat16, activation checkpointing,
and frozen attention on dense and MoE trunks.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_families import llama_dir, qwen3_dir, qwen3_moe_dir
from transformers import AutoModelForCausalLM

from saorl.config import load_config
from saorl.data.jsonl import read_jsonl
from saorl.models.loading import checkpoint_activations, load_policy
from saorl.models.serialize import load_critic
from saorl.models.tiny import build_tiny
from saorl.training import train

FAMILIES = {  # family: (builder, dtype, activation checkpointing)
    "qwen3": (qwen3_dir, "float32", False),
    "qwen3_moe": (qwen3_moe_dir, "float32", True),
    "llama": (llama_dir, "bfloat16", False),
}
RUN = ["sft.enabled=false", "value_pretrain.enabled=false", "runtime.backend=inprocess",
       "env.num_train_tasks=50", "env.num_test_tasks=4", "run.eval_tasks=2", "run.progress=false",
       "rollout.concurrent_episodes=4", "rollout.engine.slots=4", "rollout.max_new_tokens=8",
       "rollout.max_total_tokens=96", "trainer.batch_size=2", "trainer.steps=3"]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_as_policy_and_critic_exports_and_reloads(tmp_path, family):
    build, dtype, checkpointing = FAMILIES[family]
    path = build(tmp_path / "model")
    initial = load_policy(str(path)).state_dict()  # in-memory names (MoE experts fused)
    cfg = load_config(None, [*RUN, f"model.policy={path}", f"model.dtype={dtype}",
                             f"trainer.activation_checkpointing={str(checkpointing).lower()}"])
    run_dir, _ = train(cfg, tmp_path / "run")

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["policy/loss"]) and math.isfinite(r["critic/value_loss"]) for r in rows)
    assert rows[-1]["policy/version"] == 3
    policy = AutoModelForCausalLM.from_pretrained(str(run_dir / "final" / "policy"))
    assert type(policy).__name__ == type(load_policy(str(path))).__name__
    assert next(policy.parameters()).dtype == getattr(torch, dtype)
    exported = {k: v for k, v in policy.state_dict().items() if k in initial}
    assert any(not torch.equal(v, initial[k].to(v.dtype)) for k, v in exported.items())  # trained
    # the critic: the same trunk with a value head; frozen attention trained only the MLP
    critic = load_critic(run_dir / "final" / "critic")
    trunk = {f"model.{k}": v for k, v in critic.trunk.state_dict().items()}
    attention = [k for k in trunk if ".self_attn." in k and k in initial]
    mlp = [k for k in trunk if ".mlp." in k and k in initial and ".gate.weight" not in k]
    assert attention and mlp
    start = {k: initial[k].to(trunk[k].dtype) for k in attention + mlp}  # as loaded (bf16 rounds)
    assert all(torch.equal(trunk[k], start[k]) for k in attention)
    assert any(not torch.equal(trunk[k], start[k]) for k in mlp)


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_gradients():
    ids = torch.randint(2, 1000, (2, 24), generator=torch.Generator().manual_seed(0))

    def run(model) -> tuple[int, dict[str, torch.Tensor]]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
        return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = (build_tiny("tiny-moe", seed=0, num_hidden_layers=2).train() for _ in range(2))
    checkpoint_activations(ckpt)
    (kept_plain, grads_plain), (kept_ckpt, grads_ckpt) = run(plain), run(ckpt)
    assert kept_ckpt < kept_plain / 2
    assert set(grads_plain) == set(grads_ckpt)
    assert all(torch.allclose(grads_plain[n], grads_ckpt[n], atol=1e-6) for n in grads_plain)
