"""The learner with ``algo.critic_train_layers``: what a step moves, the frozen lower blocks run
once per micro-batch, and N = all layers giving the default step to the bit."""


import pytest
import torch
from test_learner import _trajs as learner_trajs

from saorl.algo.registry import get_preset
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import Learner, OptimConfig

PAD = 1
LOWER = "critic lower blocks (no grad, once)"


def _trajs(seed=0):
    return learner_trajs(6, seed)


def _learner(kind="tiny-dense", max_tokens=4096, **over):
    policy = build_tiny(kind, seed=0)
    preset = get_preset("sao").with_overrides(**over)
    return Learner(policy, Critic.from_policy(policy, seed=0), preset,
                   OptimConfig(policy_lr=1e-3, critic_lr=1e-3), pad_id=PAD,
                   max_tokens_per_microbatch=max_tokens)


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_a_step_moves_only_the_top_blocks_mlp_and_the_head(kind):
    lrn = _learner(kind, critic_train_layers=2)
    before = _snapshot(lrn.critic)
    lrn.step(_trajs())
    moved = {n for n, p in lrn.critic.named_parameters() if not torch.equal(before[n], p.detach())}
    top = ("trunk.layers.2.mlp.", "trunk.layers.3.mlp.")
    allowed = {n for n in before if n.startswith("value_head.")
               or (n.startswith(top) and "mlp.gate.weight" not in n)}
    assert moved and moved <= allowed
    assert {"value_head.weight", "trunk.layers.3.mlp.down_proj.weight" if kind == "tiny-dense"
            else "trunk.layers.3.mlp.experts.down_proj"} <= moved
    assert len(lrn.critic_params) == len(allowed)


def test_the_lower_blocks_run_once_per_microbatch_for_every_pass():
    lrn = _learner(max_tokens=48, critic_train_layers=1, critic_updates=3, value_clip=0.2)
    lrn.step(_trajs())
    calls = lrn.timings.calls
    micro = calls[LOWER]
    assert micro >= 2  # several micro-batches, each's lower part computed once
    assert calls["critic forward (grad)"] == 3 * micro  # K = 3 update passes
    assert calls["critic forward (no grad)"] == 2 * micro  # the values before (clip) and after


def test_all_layers_trained_this_way_is_the_default_step_to_the_bit():
    layers = build_tiny("tiny-dense", seed=0).config.num_hidden_layers
    runs = []
    for over in ({}, {"critic_train_layers": layers}):
        lrn = _learner(max_tokens=64, **over)
        metrics = [dict(lrn.step(_trajs(seed=s))) for s in range(2)]
        runs.append((metrics, _snapshot(lrn.critic), _snapshot(lrn.policy)))
        assert (LOWER in lrn.timings.calls) == bool(over)
    (m0, c0, p0), (m1, c1, p1) = runs
    assert all(torch.equal(c0[n], c1[n]) for n in c0) and all(torch.equal(p0[n], p1[n]) for n in p0)
    for a, b in zip(m0, m1):
        assert a.keys() == b.keys()
        assert all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)  # NaN == NaN


def test_too_many_layers_for_the_model_is_one_clear_error():
    with pytest.raises(ValueError, match=r"algo\.critic_train_layers must be in \[1, 4\].*got 5"):
        _learner(critic_train_layers=5)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["algo.critic_train_layers=0"], "algo.critic_train_layers: Input should be greater than or equal to 1"),
    (["algo.name=grpo", "algo.critic_train_layers=2"], "trains no critic"),
    (["algo.critic_train_layers=2", "model.lora.critic=true", "model.lora.rank=8"],
     "algo.critic_train_layers: is 2, but model.lora.critic"),
    (["algo.critic_train_layers=2", "trainer.shard=fsdp2"], "is 2, but the sharded"),
])
def test_the_setting_is_checked_at_load(overrides, expected):
    from saorl.config import ConfigError, load_config

    assert load_config(None).algo.preset.critic_train_layers is None  # the default: off
    assert load_config(None, ["algo.critic_train_layers=3"]).algo.preset.critic_train_layers == 3
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)
