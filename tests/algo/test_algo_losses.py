import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.algo.losses import (
    dis_policy_loss,
    entropy_from_logits,
    lm_loss,
    masked_mean,
    ppo_clip_loss,
    ratio_histogram,
    value_loss,
)

F64 = torch.float64


def lp(values):
    return torch.tensor([values], dtype=F64, requires_grad=True)


# --------------------------------------------------------------------------- naive references


def naive_dis(logprobs, rollout, adv, mask, eps_low, eps_high):
    total, n = 0.0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if not mask[b, t]:
                continue
            n += 1
            ratio = torch.exp(logprobs[b, t] - rollout[b, t])
            if 1 - eps_low <= ratio.item() <= 1 + eps_high:
                total = total + ratio * adv[b, t]
    return -total / max(n, 1)


def naive_ppo(logprobs, old, adv, mask, eps_low, eps_high):
    total, n = 0.0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if not mask[b, t]:
                continue
            n += 1
            ratio = torch.exp(logprobs[b, t] - old[b, t])
            total = total + torch.minimum(ratio * adv[b, t],
                                          ratio.clamp(1 - eps_low, 1 + eps_high) * adv[b, t])
    return -total / max(n, 1)


def random_policy_batch(seed, B=5, T=12):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.6).long()
    rollout = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logprobs = (rollout + torch.randn(B, T, generator=g, dtype=F64) * 0.7).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return logprobs, rollout, adv, mask


# --------------------------------------------------------------------------- DIS


def test_dis_hand_case():
    # ratios 0.5 (below 0.7: masked), 1.2 (kept), 7 (above 6: masked), 1 (kept); last token off-mask
    rollout = torch.tensor([[-1.0, -1.0, -3.0, -2.0, 0.0]], dtype=F64)
    logprobs = lp([-1.0 + math.log(0.5), -1.0 + math.log(1.2), -3.0 + math.log(7.0), -2.0, 40.0])
    adv = torch.tensor([[1.0, 2.0, 3.0, -1.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, m = dis_policy_loss(logprobs, rollout, adv, mask, 0.3, 5.0)
    # -(1.2*2 + 1*(-1)) / 4 (the two masked tokens still count in the denominator)
    assert loss.item() == pytest.approx(-0.35)
    assert m["policy/dis_kept_frac"] == 0.5
    assert m["policy/dis_masked_low_frac"] == 0.25 and m["policy/dis_masked_high_frac"] == 0.25
    assert m["policy/ratio_mean"] == pytest.approx((0.5 + 1.2 + 7 + 1) / 4)
    assert m["policy/ratio_max"] == pytest.approx(7.0) and m["policy/ratio_min"] == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -ratio*A/4 = -ratio*A/4 on kept tokens, exactly 0 elsewhere
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.6, 0.0, 0.25, 0.0]], dtype=F64))
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 2] == 0 and logprobs.grad[0, 4] == 0


@pytest.mark.parametrize("seed", range(4))
def test_dis_matches_naive_loop_value_and_grad(seed):
    logprobs, rollout, adv, mask = random_policy_batch(seed)
    loss, metrics = dis_policy_loss(logprobs, rollout, adv, mask, 0.3, 0.5)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ref = naive_dis(logprobs, rollout, adv, mask, 0.3, 0.5)
    (ref_grad,) = torch.autograd.grad(ref, logprobs)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    fracs = metrics["policy/dis_kept_frac"] + metrics["policy/dis_masked_low_frac"]
    assert fracs + metrics["policy/dis_masked_high_frac"] == pytest.approx(1.0)
    assert 0 < metrics["policy/dis_kept_frac"] < 1  # the random batch exercises both sides


def test_dis_masked_tokens_get_exactly_zero_grad_even_with_garbage():
    logprobs, rollout, adv, mask = random_policy_batch(7)
    with torch.no_grad():  # off-mask garbage that would give exp(1000) = inf and 0 * inf = nan
        logprobs[mask == 0] = 500.0
        rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, -500.0))
        adv = torch.where(mask.bool(), adv, torch.full_like(adv, float("nan")))
    loss, metrics = dis_policy_loss(logprobs, rollout, adv, mask, 0.2, 0.28)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[mask == 0] == 0)
    ratio = torch.exp(logprobs.detach() - rollout)
    outside = mask.bool() & ((ratio < 0.8) | (ratio > 1.28))
    assert outside.any() and torch.all(logprobs.grad[outside] == 0)
    assert math.isfinite(metrics["policy/ratio_max"])


def test_dis_on_policy_ratio_is_one_and_everything_kept():
    _logprobs, rollout, adv, mask = random_policy_batch(3)
    same = rollout.clone().requires_grad_(True)
    loss, m = dis_policy_loss(same, rollout, adv, mask, 0.0, 1e-9)  # even a zero-width band keeps ratio 1
    assert m["policy/dis_kept_frac"] == 1.0 and m["policy/dis_masked_low_frac"] == 0.0
    assert m["policy/ratio_mean"] == m["policy/ratio_max"] == m["policy/ratio_min"] == 1.0
    # on-policy the loss is -mean(A) over action tokens (the REINFORCE surrogate)
    assert loss.item() == pytest.approx(-adv[mask.bool()].mean().item())


def test_dis_empty_batch_is_zero_with_graph():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, m = dis_policy_loss(logprobs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 0.3, 5.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logprobs.grad == 0)
    assert m["policy/dis_kept_frac"] == 1.0


def test_dis_rejects_bad_band_and_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="eps_low"):
        dis_policy_loss(x, x, x, x, 1.0, 0.2)
    with pytest.raises(ValueError, match="eps_high"):
        dis_policy_loss(x, x, x, x, 0.2, 0.0)
    with pytest.raises(ValueError, match="advantages"):
        dis_policy_loss(x, x, torch.zeros(2, 4), x, 0.2, 0.2)


# --------------------------------------------------------------------------- PPO


def test_ppo_hand_case():
    old = torch.zeros(1, 5, dtype=F64)
    logprobs = lp([math.log(0.5), math.log(1.5), math.log(0.5), math.log(1.2), 50.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, 0.2, 0.28)
    # min terms: 0.5 (unclipped), 1.28 (clipped), -0.8 (clipped), -2.4 (inside) -> -(-1.42)/4
    assert loss.item() == pytest.approx(0.355)
    assert m["policy/clip_frac"] == 0.5
    assert m["policy/ratio_max"] == pytest.approx(1.5) and m["policy/ratio_mean"] == pytest.approx(0.925)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.125, 0.0, 0.0, 0.6, 0.0]], dtype=F64))


@pytest.mark.parametrize("seed", range(4))
def test_ppo_matches_naive_loop_value_and_grad(seed):
    logprobs, old, adv, mask = random_policy_batch(seed + 10)
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, 0.2, 0.28)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ref = naive_ppo(logprobs, old, adv, mask, 0.2, 0.28)
    (ref_grad,) = torch.autograd.grad(ref, logprobs)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert torch.all(grad[mask == 0] == 0)
    assert 0 < m["policy/clip_frac"] < 1


def test_ppo_off_mask_garbage_gets_exactly_zero_grad():
    logprobs, old, adv, mask = random_policy_batch(5)
    with torch.no_grad():
        logprobs[mask == 0] = 500.0
        old = torch.where(mask.bool(), old, torch.full_like(old, -500.0))
        adv = torch.where(mask.bool(), adv, torch.full_like(adv, float("inf")))
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, 0.2, 0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[mask == 0] == 0) and math.isfinite(m["policy/ratio_max"])


def test_ppo_on_policy_has_no_clipping():
    _logprobs, old, adv, mask = random_policy_batch(2)
    loss, m = ppo_clip_loss(old.clone().requires_grad_(True), old, adv, mask, 0.2, 0.2)
    assert m["policy/clip_frac"] == 0.0 and m["policy/ratio_mean"] == 1.0
    assert loss.item() == pytest.approx(-adv[mask.bool()].mean().item())


# --------------------------------------------------------------------------- value, LM, entropy


def test_value_loss_hand_case():
    values = lp([1.0, 2.0, 3.0, 99.0])
    returns = torch.tensor([[2.0, 2.0, 5.0, -99.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, returns, mask)
    # squared errors 1, 0, 4 -> 0.5 * 5 / 3
    assert loss.item() == pytest.approx(5 / 6) and m["critic/value_loss"] == pytest.approx(5 / 6)
    # Var[R] = 2 (R = 2, 2, 5), Var[R - V] = 2/3 (1, 0, 2) -> 1 - 1/3
    assert m["critic/explained_var"] == pytest.approx(2 / 3)
    assert m["critic/value_mean"] == pytest.approx(2.0) and m["critic/return_mean"] == pytest.approx(3.0)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-1 / 3, 0.0, -2 / 3, 0.0]], dtype=F64))


def test_value_loss_clipped_hand_case():
    values = lp([1.0, 2.0, 3.0])
    returns = torch.tensor([[2.0, 2.0, 5.0]], dtype=F64)
    old = torch.tensor([[0.0, 2.0, 3.0]], dtype=F64)
    loss, m = value_loss(values, returns, torch.ones(1, 3), old_values=old, clip=0.5)
    # V_clip = 0.5, 2, 3 -> clipped squared errors 2.25, 0, 4; max with 1, 0, 4 -> 2.25, 0, 4
    assert loss.item() == pytest.approx(0.5 * 6.25 / 3)
    assert m["critic/clip_frac"] == pytest.approx(1 / 3)
    loss.backward()  # token 0 is on the clipped branch, so its gradient is 0
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, -2 / 3]], dtype=F64))
    with pytest.raises(ValueError, match="together"):
        value_loss(values, returns, torch.ones(1, 3), old_values=old)


def test_value_loss_perfect_critic_explains_everything():
    returns = torch.randn(3, 6, dtype=F64)
    loss, m = value_loss(returns.clone(), returns, torch.ones(3, 6))
    assert loss.item() == 0.0 and m["critic/explained_var"] == pytest.approx(1.0)


def test_explained_var_is_zero_when_returns_are_constant_up_to_rounding():
    # every trajectory got reward 1; float32 GAE leaves rounding noise (~1e-8) in the returns
    returns = (torch.ones(2, 5) + torch.tensor([0.0, 1e-8, -1e-8, 0.0, 3e-8])).float()
    values = torch.full((2, 5), 0.3)
    _, m = value_loss(values, returns, torch.ones(2, 5))
    assert m["critic/explained_var"] == 0.0  # not -1e13
    spread = returns + torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0])  # real spread: the ratio is computed
    _, m = value_loss(spread.clone(), spread, torch.ones(2, 5))
    assert m["critic/explained_var"] == pytest.approx(1.0)


def test_lm_loss_hand_case_and_zero_weight_rows():
    logprobs = torch.tensor([[-1.0, -2.0, float("-inf")], [-3.0, -4.0, -5.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = lm_loss(logprobs, mask, torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(1.5)  # (1 + 2) / 2 tokens of the positive trajectory
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]], dtype=F64))
    none = lm_loss(logprobs, mask, torch.zeros(2))
    assert none.item() == 0.0 and none.requires_grad
    with pytest.raises(ValueError, match="weights"):
        lm_loss(logprobs, mask, torch.ones(3))


def test_entropy_from_logits():
    V = 7
    uniform = torch.zeros(2, 3, V)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(V)))
    peaked = torch.zeros(1, 1, V)
    peaked[..., 0] = 60.0
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(2, 4, V, dtype=F64)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))


def test_masked_mean_ignores_garbage():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(3.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_ratio_histogram_counts():
    ratio = torch.tensor([1e-4, 0.5, 1.0, 1.0, 2.0, 1e5, float("nan"), 3.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0])
    counts, edges = ratio_histogram(ratio, mask, bins=4, lo=0.01, hi=100.0)
    torch.testing.assert_close(edges, torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0], dtype=F64))
    # [<0.1 incl. below-range 1e-4], [0.1, 1): 0.5, [1, 10): 1, 1, 2, [10, ...): 1e5; nan and off-mask dropped
    assert counts.tolist() == [1, 1, 3, 1]


# --------------------------------------------------------------------------- properties


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(-2, 2), st.booleans()), min_size=1, max_size=12),
       st.floats(0.0, 0.9), st.floats(0.01, 5.0))
def test_property_dis_grad_zero_exactly_where_not_kept(rows, eps_low, eps_high):
    log_ratio = torch.tensor([[r[0] for r in rows]], dtype=F64)
    adv = torch.tensor([[r[1] for r in rows]], dtype=F64)
    mask = torch.tensor([[int(r[2]) for r in rows]])
    logprobs = (log_ratio - 1.0).requires_grad_(True)
    loss, _m = dis_policy_loss(logprobs, torch.full_like(log_ratio, -1.0), adv, mask, eps_low, eps_high)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = torch.exp(logprobs.detach() + 1.0)
    keep = mask.bool() & (ratio >= 1 - eps_low) & (ratio <= 1 + eps_high)
    assert torch.all(grad[~keep] == 0)
    n = max(int(mask.sum()), 1)
    torch.testing.assert_close(grad[keep], -(ratio * adv)[keep] / n)
