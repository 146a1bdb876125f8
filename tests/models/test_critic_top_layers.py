"""A critic that trains only its top blocks (``algo.critic_train_layers``): the same values as the
whole trunk, its frozen lower part run once and reused, gradients as a full backward gives them."""

import copy

import pytest
import torch

from saorl.models.critic import Critic
from saorl.models.lora import attach_critic_lora
from saorl.models.packed import use_varlen_attention
from saorl.models.tiny import build_tiny


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def policy(request):
    return build_tiny(request.param, seed=0)


def _padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1000, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return ids, {"attention_mask": mask}


def _packed(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1000, (1, 12), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    return ids, {"attention_mask": None, "position_ids": pos, "cu_seqlens": torch.tensor([0, 5, 8, 12])}


def _pair(policy, layers, frozen=True):
    """A whole-trunk critic and a copy of it that trains its top ``layers`` blocks."""
    full = Critic.from_policy(policy, seed=3)
    full.set_frozen_attention(frozen)
    top = copy.deepcopy(full)
    top.set_frozen_attention(frozen, layers=layers)
    for c in (full, top):
        use_varlen_attention(c.trunk)
    return full, top


@pytest.mark.parametrize("inputs", [_padded, _packed])
@pytest.mark.parametrize("layers", [1, 2, 4])
def test_values_equal_the_whole_trunk_exactly(policy, inputs, layers):
    full, top = _pair(policy, layers)
    ids, kw = inputs()
    with torch.no_grad():
        want = full(ids, **kw)
        lower = top.frozen_hidden(ids, **kw)
        assert lower is not None and lower.shape == (*ids.shape, policy.config.hidden_size)
        assert torch.equal(top(ids, **kw), want)
        assert torch.equal(top(ids, **kw, lower=lower), want)  # reused: still the same numbers
    assert top.train_layers == layers and full.train_layers is None
    assert full.frozen_hidden(ids, **kw) is None
    # the module tree is whole again after the partial passes
    assert dict(top.named_parameters()).keys() == dict(full.named_parameters()).keys()
    assert not any(type(m).__name__ == "_PassThrough" for m in top.modules())


def test_only_the_top_blocks_mlp_and_the_head_train(policy):
    layers = policy.config.num_hidden_layers
    _, top = _pair(policy, 2)
    trainable = {n for n, p in top.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    blocks = {int(n.split(".")[2]) for n in trainable if n.startswith("trunk.layers.")}
    assert blocks == {layers - 2, layers - 1}
    assert all(".mlp." in n for n in trainable if n.startswith("trunk."))
    frozen = ("self_attn", "norm", "embed", "mlp.gate.weight")
    assert not any(f in n for f in frozen for n in trainable)
    # without frozen attention: the whole top blocks and the final norm
    _, whole = _pair(policy, 1, frozen=False)
    trainable = {n for n, p in whole.named_parameters() if p.requires_grad}
    top_block = {n for n, _ in whole.named_parameters() if n.startswith(f"trunk.layers.{layers - 1}.")}
    assert trainable == top_block | {"trunk.norm.weight", "value_head.weight", "value_head.bias"}


def test_gradients_equal_a_full_backward_with_the_lower_blocks_frozen(policy):
    full, top = _pair(policy, 2)
    for name, p in full.named_parameters():  # the same trainable set, on the whole-trunk path
        p.requires_grad_(dict(top.named_parameters())[name].requires_grad)
    ids, kw = _packed()
    target = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    (full(ids, **kw) - target).pow(2).sum().backward()
    lower = top.frozen_hidden(ids, **kw)
    for _ in range(2):  # K = 2 passes on one cached lower part: the same gradient each time
        top.zero_grad(set_to_none=True)
        (top(ids, **kw, lower=lower) - target).pow(2).sum().backward()
        grads = {n: p.grad for n, p in top.named_parameters() if p.requires_grad}
        assert grads and all(g is not None for g in grads.values())
        for n, g in grads.items():
            torch.testing.assert_close(g, dict(full.named_parameters())[n].grad, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in top.parameters() if not p.requires_grad)


def test_the_default_changes_nothing(policy):
    a = Critic.from_policy(policy, seed=3)
    b = copy.deepcopy(a)
    names_a = a.set_frozen_attention(True)
    names_b = b.set_frozen_attention(True, layers=None)
    assert names_a == names_b and b.train_layers is None
    ids, kw = _padded()
    with torch.no_grad():
        assert torch.equal(a(ids, **kw), b(ids, **kw))
    with pytest.raises(ValueError, match="no frozen lower part"):
        b(ids, **kw, lower_only=True)
    # setting it and then clearing it restores every block's MLP
    b.set_frozen_attention(True, layers=1)
    assert b.set_frozen_attention(True) == names_a and b.train_layers is None


@pytest.mark.parametrize("bad", [0, -1, 5, True])
def test_a_count_outside_the_trunk_is_refused(policy, bad):
    critic = Critic.from_policy(policy)
    with pytest.raises(ValueError, match=r"algo\.critic_train_layers must be in \[1, 4\].*has 4 blocks"):
        critic.set_frozen_attention(True, layers=bad)


def test_a_lora_critic_refuses_top_layers(policy):
    critic = attach_critic_lora(Critic.from_policy(policy), rank=2, alpha=4.0, dropout=0.0,
                                targets=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="critic_train_layers=2 does not combine with a LoRA critic"):
        critic.set_frozen_attention(True, layers=2)
