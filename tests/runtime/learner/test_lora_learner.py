"""The learner with a LoRA policy on the tiny models: what trains, what the engine samples with,
the non-finite guard and an exact checkpoint round trip."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from saorl.algo.registry import get_preset
from saorl.config.sections import LORA_TARGETS
from saorl.data.batch import collate
from saorl.data.trajectory import Trajectory
from saorl.engines.base import SamplingParams
from saorl.engines.local import LocalEngine
from saorl.models.critic import Critic
from saorl.models.logprobs import token_logprobs
from saorl.models.lora import attach_lora
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.learner.single import Learner, OptimConfig
from saorl.runtime.weights.files import FilePublisher, FileSource
from tests.runtime.learner.test_learner import PAD, _matched_trajs, _opt_state, _trajs


def _lora_learner(kind="tiny-dense", seed=0, lr=1e-2, **over) -> Learner:
    policy = build_tiny(kind, seed=seed)
    critic = Critic.from_policy(policy)  # from the plain policy, as the run builds it
    policy = attach_lora(policy, rank=8, alpha=16.0, dropout=0.0, targets=list(LORA_TARGETS),
                         optional=LORA_TARGETS, base={"policy": kind, "seed": seed}, seed=seed)
    preset = get_preset("sao").with_overrides(**over) if over else get_preset("sao")
    return Learner(policy, critic, preset, OptimConfig(policy_lr=lr, critic_lr=1e-3), pad_id=PAD)


def _named(module, lora: bool):
    return {n: p.detach().clone() for n, p in module.named_parameters() if ("lora_" in n) == lora}


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_only_the_adapter_trains_and_the_base_stays_bit_identical(kind):
    lrn = _lora_learner(kind)
    adapters = {n for n, p in lrn.policy.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    held = {id(p) for g in lrn.policy_opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in lrn.policy.named_parameters() if n in adapters}
    if kind == "tiny-moe":  # fused experts and the router are not nn.Linear: frozen with the base
        assert not any("experts" in n or ".mlp.gate." in n for n in adapters)
    base, lora = _named(lrn.policy, False), _named(lrn.policy, True)
    trajs = _trajs()
    lrn.step(_matched_trajs(lrn.policy, trajs))
    lrn.step(_matched_trajs(lrn.policy, trajs))
    after_base, after_lora = _named(lrn.policy, False), _named(lrn.policy, True)
    assert all(torch.equal(base[n], after_base[n]) for n in base)
    moved = {n for n in lora if not torch.equal(lora[n], after_lora[n])}
    # B starts at 0, so A gets no gradient on the first step; after two steps both have moved
    assert any(".lora_B." in n for n in moved) and any(".lora_A." in n for n in moved)
    assert all(p.grad is None for n, p in lrn.policy.named_parameters() if n not in adapters)


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_the_local_engine_samples_from_exactly_base_plus_the_published_adapter(kind, tmp_path):
    lrn = _lora_learner(kind)
    for _ in range(2):
        lrn.step(_matched_trajs(lrn.policy, _trajs()))
    sync = FilePublisher(tmp_path / "weights")
    lrn.publish(sync)
    version, source = FileSource(tmp_path / "weights").latest()
    assert version == lrn.version == 2 and source.endswith("v00000002-adapter")
    tok = load_tokenizer()
    engine = LocalEngine(build_tiny(kind, seed=0), tok, max_batch_size=4)
    try:
        engine.update_weights(source, version)
        prompts = [list(tok.encode(s)) for s in ("12+30=", "the sweet moon", "def f(x):")]
        torch.manual_seed(0)
        results = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16))
    finally:
        engine.close()
    trajs = [Trajectory(p + r.token_ids, [0] * len(p) + [1] * len(r.token_ids),
                        [0.0] * len(p) + r.logprobs, [0.0] * (len(p) + len(r.token_ids)),
                        [-1] * len(p) + r.versions, len(p)) for p, r in zip(prompts, results)]
    b = collate(trajs, PAD)
    with torch.no_grad():
        scored = token_logprobs(lrn.policy, b.input_ids, b.attention_mask)
    gap = ((scored - b.rollout_logprobs).abs() * b.action_mask).max().item()
    assert all(r.versions == [2] * len(r.token_ids) for r in results)
    assert gap < 1e-5  # float32: the merged W + s·B·A against peft's W·x + s·B·A·x
    plain = build_tiny(kind, seed=0)  # and the adapter matters: the base alone scores differently
    with torch.no_grad():
        base_gap = ((token_logprobs(plain, b.input_ids, b.attention_mask) - b.rollout_logprobs).abs()
                    * b.action_mask).max().item()
    assert base_gap > 100 * max(gap, 1e-7)


def test_a_non_finite_update_of_the_adapter_is_rolled_back():
    lrn = _lora_learner("tiny-dense", lr=1e-3)
    trajs = _trajs()
    lrn.step(_matched_trajs(lrn.policy, trajs))
    lora, state = _named(lrn.policy, True), _opt_state(lrn.policy_opt)
    lrn.optim.policy_lr = lrn.optim.critic_lr = math.inf
    m = lrn.step(_matched_trajs(lrn.policy, trajs))
    assert m["train/nonfinite_skips"] == 3 and lrn.version == 1
    assert all(torch.equal(lora[n], p) for n, p in _named(lrn.policy, True).items())
    after = _opt_state(lrn.policy_opt)
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k]["exp_avg_sq"], state[k]["exp_avg_sq"]) for k in state)


def test_a_checkpoint_restores_adapter_and_optimizer_so_the_next_step_is_the_same(tmp_path):
    batches = [_trajs(seed=s) for s in range(3)]
    straight = _lora_learner("tiny-moe")
    for trajs in batches[:2]:
        straight.step(_matched_trajs(straight.policy, trajs))
    entries = straight.save_state(tmp_path)
    saved = set(load_file(str(tmp_path / "policy.safetensors")))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # the base is not rewritten
    assert entries["policy_weights"] == "lora_adapter"
    resumed = _lora_learner("tiny-moe")  # the same base (a LoRA run resumes on its base) ...
    with torch.no_grad():  # ... but another adapter than the one saved
        for n, p in resumed.policy.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    resumed.load_state(tmp_path, {**entries, **straight.counters.state()})
    assert all(torch.equal(a, b) for a, b in zip(_named(straight.policy, True).values(),
                                                 _named(resumed.policy, True).values()))
    expected = dict(straight.step(_matched_trajs(straight.policy, batches[2])))
    got = dict(resumed.step(_matched_trajs(resumed.policy, batches[2])))
    assert got == expected and got["policy/version"] == 3


def test_a_full_checkpoint_is_refused_by_a_lora_learner_in_one_paragraph(tmp_path):
    policy = build_tiny("tiny-dense")
    full = Learner(policy, Critic.from_policy(policy), get_preset("sao"), OptimConfig(), pad_id=PAD)
    entries = full.save_state(tmp_path)
    with pytest.raises(ValueError, match="holds the policy's full weights, but this learner trains a LoRA"):
        _lora_learner().load_state(tmp_path, {**entries, **full.counters.state()})


def test_packed_lora_updates_equal_padded_ones_and_the_adapter_init_follows_the_seed():
    packed, padded = _lora_learner("tiny-dense"), _lora_learner("tiny-dense")
    assert all(torch.equal(a, b) for a, b in zip(_named(packed.policy, True).values(),
                                                 _named(padded.policy, True).values()))
    other = _named(_lora_learner("tiny-dense", seed=1).policy, True)
    assert not any(torch.equal(a, other[n]) for n, a in _named(packed.policy, True).items() if "lora_A" in n)
    padded.packing = False
    for model in (padded.policy, padded.critic.trunk):
        model.set_attn_implementation("sdpa")
    assert packed.policy.config._attn_implementation == "sdpa_varlen"
    packed.max_tokens = padded.max_tokens = 40
    for seed in range(2):
        trajs = _trajs(seed=seed)
        a = packed.step(_matched_trajs(packed.policy, trajs))
        b = padded.step(_matched_trajs(padded.policy, trajs))
        assert a["throughput/microbatches"] == b["throughput/microbatches"] == 2
        for k in ("policy/loss", "policy/grad_norm", "critic/value_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), k
    # equal up to rounding, which Adam's g / sqrt(v) lifts for near-zero gradients (steps of 1e-2)
    for n, p in _named(packed.policy, True).items():
        assert torch.allclose(p, _named(padded.policy, True)[n], atol=5e-4), n


def _lora_critic_learner(kind="tiny-dense", seed=0) -> Learner:
    from saorl.models.lora import attach_critic_lora

    lrn = _lora_learner(kind, seed=seed)
    attach_critic_lora(lrn.critic, rank=8, alpha=16.0, dropout=0.0, targets=list(LORA_TARGETS),
                       optional=LORA_TARGETS, seed=seed)
    # the learner's optimizer was built for the default critic: build it again, as a run would
    return Learner(lrn.policy, lrn.critic, lrn.preset, lrn.optim, pad_id=PAD)


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_a_lora_critic_trains_its_adapter_and_head_only(kind):
    lrn = _lora_critic_learner(kind)
    held = {id(p) for g in lrn.critic_opt.param_groups for p in g["params"]}
    names = {n for n, p in lrn.critic.named_parameters() if id(p) in held}
    assert "value_head.weight" in names and "value_head.bias" in names
    assert all(n.startswith("value_head.") or ".lora_A." in n or ".lora_B." in n for n in names)
    assert any("self_attn" in n for n in names) and any("mlp" in n for n in names) == (kind == "tiny-dense")
    base = {n: p.detach().clone() for n, p in lrn.critic.named_parameters() if n not in names}
    trainable = {n: p.detach().clone() for n, p in lrn.critic.named_parameters() if n in names}
    # one step is K = 2 critic updates: B moves on the first, A (zero gradient while B is 0) on the second
    assert lrn.preset.critic_updates == 2
    lrn.step(_matched_trajs(lrn.policy, _trajs()))
    after = dict(lrn.critic.named_parameters())
    assert all(torch.equal(base[n], after[n]) for n in base)  # attention, MLP and experts alike
    moved = {n for n in trainable if not torch.equal(trainable[n], after[n])}
    assert "value_head.weight" in moved and any(".lora_A." in n for n in moved)


def test_a_checkpoint_restores_a_lora_critic_so_the_next_step_is_the_same(tmp_path):
    batches = [_trajs(seed=s) for s in range(3)]
    straight = _lora_critic_learner()
    for trajs in batches[:2]:
        straight.step(_matched_trajs(straight.policy, trajs))
    entries = straight.save_state(tmp_path)
    saved = load_file(str(tmp_path / "critic.safetensors"))
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in saved.items())  # the adapter trained
    resumed = _lora_critic_learner()
    resumed.load_state(tmp_path, {**entries, **straight.counters.state()})
    expected = dict(straight.step(_matched_trajs(straight.policy, batches[2])))
    got = dict(resumed.step(_matched_trajs(resumed.policy, batches[2])))
    assert got == expected and got["critic/value_loss"] > 0
    with pytest.raises(ValueError, match="holds a LoRA critic, but this learner trains the default critic: "
                                         "resume with the model"):
        _lora_learner().load_state(tmp_path, {**entries, **straight.counters.state()})
