import pytest
import torch

from saorl.models.critic import Critic
from saorl.models.loading import load_policy


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def policy(request):
    return load_policy(request.param, seed=0)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1024, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    ids[1, 5:] = 1
    return ids, mask


def test_values_shape_zeros_and_deep_copy(policy):
    critic = Critic.from_policy(policy)
    ids, mask = _batch()
    v = critic(ids, mask)
    assert v.shape == (3, 8) and v.dtype == torch.float32
    assert torch.all(v[:, 0] == 0) and torch.all(v[1, 5:] == 0)
    assert torch.all(v[0, 1:] != 0)
    before = policy.model.norm.weight.clone()
    with torch.no_grad():
        critic.trunk.norm.weight.add_(1.0)
    assert torch.equal(policy.model.norm.weight, before)


def test_value_at_t_reads_hidden_at_t_minus_1(policy):
    critic = Critic.from_policy(policy)
    ids, mask = _batch()
    with torch.no_grad():
        hidden = critic.trunk(input_ids=ids[:1], attention_mask=mask[:1]).last_hidden_state
        v = critic(ids, mask)
        assert torch.allclose(v[0, 1:], critic.value_head(hidden[0, :-1]).squeeze(-1), atol=1e-6)
        t = 4
        changed = ids.clone()
        changed[:, t] = (ids[:, t] + 7) % 1000 + 2
        v2 = critic(changed, mask)
    assert torch.allclose(v[:, : t + 1], v2[:, : t + 1], atol=1e-6)  # V(s_t) does not see x_t
    assert not torch.allclose(v[0, t + 1], v2[0, t + 1])


def test_padding_invariance_right_and_left(policy):
    critic = Critic.from_policy(policy)
    ids, mask = _batch()
    with torch.no_grad():
        alone = critic(ids[1:2, :5], mask[1:2, :5])
        batched = critic(ids, mask)
        left_ids, left_mask = (torch.cat([x[1:2, 5:], x[1:2, :5]], 1) for x in (ids, mask))
        left = critic(left_ids, left_mask)
    assert torch.allclose(alone[0], batched[1, :5], atol=1e-5)
    assert torch.allclose(alone[0], left[0, 3:], atol=1e-5) and torch.all(left[0, :3] == 0)


def _critic_loss(critic, ids, mask):
    return ((critic(ids, mask) - 1.0) ** 2).sum()


def test_frozen_attention_grads_and_step(policy):
    critic = Critic.from_policy(policy)
    trainable = set(critic.set_frozen_attention(True))
    experts = "experts.gate_up_proj" if hasattr(critic.trunk.layers[0].mlp, "experts") else "mlp.up_proj"
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert sum(experts in n for n in trainable) == 4
    for frozen in ("q_proj", "k_proj", "o_proj", "k_norm", "q_norm", "layernorm", "embed_tokens",
                   "mlp.gate.weight", "trunk.norm.weight"):
        assert not any(frozen in n for n in trainable), frozen
    ids, mask = _batch()
    _critic_loss(critic, ids, mask).backward()
    with_grad = {n for n, p in critic.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad == trainable
    assert all(p.grad is None for n, p in critic.named_parameters() if n not in trainable)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    opt = torch.optim.Adam(critic.trainable_parameters(), lr=1e-3)
    opt.step()
    changed = {n for n, p in critic.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable


def test_unfrozen_critic_trains_attention(policy):
    critic = Critic.from_policy(policy)
    critic.set_frozen_attention(True)
    trainable = critic.set_frozen_attention(False)
    assert trainable == [n for n, _ in critic.named_parameters()]
    ids, mask = _batch()
    _critic_loss(critic, ids, mask).backward()
    grads = {n: p.grad for n, p in critic.named_parameters()}
    assert grads["trunk.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    assert grads["trunk.layers.0.self_attn.k_norm.weight"].abs().sum() > 0
    assert grads["trunk.embed_tokens.weight"].abs().sum() > 0


def test_from_spec_and_head_init():
    critic = Critic.from_policy("tiny-dense", seed=5)
    w = critic.value_head.weight
    assert w.shape == (1, 128) and torch.all(critic.value_head.bias == 0)
    assert 0 < w.std().item() < 3 / 129
    zero = Critic.from_policy("tiny-dense", head_init_std=0.0)
    ids, mask = _batch()
    assert torch.all(zero(ids, mask) == 0)
