import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.algo.gae import (
    credit_rewards,
    length_adaptive_lambda,
    mc_returns,
    skip_observation_gae,
    token_gae,
)

# --------------------------------------------------------------------------- naive references


def naive_skip_obs_gae(rewards, values, mask, gamma, lams):
    """Per-row, per-token Python loop written straight from the formulas in docs/method.md."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        acts = [t for t in range(T) if mask[b, t]]
        if not acts:
            continue
        r = {a: 0.0 for a in acts}
        for t in range(T):
            before = [a for a in acts if a <= t]
            r[before[-1] if before else acts[0]] += float(rewards[b, t])
        lam = float(lams[b])
        running = 0.0
        for k in reversed(range(len(acts))):
            v_next = float(values[b, acts[k + 1]]) if k + 1 < len(acts) else 0.0
            delta = r[acts[k]] + gamma * v_next - float(values[b, acts[k]])
            running = delta + gamma * lam * running
            adv[b, acts[k]] = running
            ret[b, acts[k]] = running + float(values[b, acts[k]])
    return adv, ret


def naive_textbook_gae(rewards, values, response, gamma, lam):
    """Textbook dense GAE over a contiguous response span: next state is simply t + 1."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        pos = [t for t in range(T) if response[b, t]]
        running = 0.0
        for t in reversed(pos):
            v_next = float(values[b, t + 1]) if t + 1 < T and response[b, t + 1] else 0.0
            delta = float(rewards[b, t]) + gamma * v_next - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv


# --------------------------------------------------------------------------- hand-computed cases


def test_skip_obs_gae_hand_case():
    # positions: 0 prompt, 1 act, 2 act, 3 obs, 4 act, 5 obs
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]])
    values = torch.tensor([[7.0, 0.5, 1.0, -9.0, 2.0, 4.0]])
    # prompt reward 0.5 -> first action (pos 1); obs reward 1 -> pos 2; trailing obs reward 3 -> pos 4
    rewards = torch.tensor([[0.5, 0.0, 0.0, 1.0, 0.0, 3.0]])
    # gamma = lam = 0.5 (gamma*lam = 0.25); credited r = 0.5, 1, 3 at V = 0.5, 1, 2
    #   d3 = 3 + 0 - 2 = 1                  A3 = 1
    #   d2 = 1 + 0.5*2 - 1 = 1              A2 = 1 + 0.25*1 = 1.25
    #   d1 = 0.5 + 0.5*1 - 0.5 = 0.5        A1 = 0.5 + 0.25*1.25 = 0.8125
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.8125, 1.25, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.3125, 2.25, 0.0, 3.0, 0.0]]))
    # Monte-Carlo returns along the chain, gamma = 0.5: R3 = 3, R2 = 1 + 1.5, R1 = 0.5 + 1.25
    expected_mc = torch.tensor([[0.0, 1.75, 2.5, 0.0, 3.0, 0.0]])
    torch.testing.assert_close(mc_returns(rewards, mask, 0.5), expected_mc)


def test_gamma_lambda_one_gives_return_minus_value():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0]])
    values = torch.tensor([[9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 9.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, 1.0, 1.0)
    # returns-to-go along the chain: 3, 3, 2, 2
    torch.testing.assert_close(ret, torch.tensor([[0.0, 3.0, 3.0, 0.0, 2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.0, 1.0, 0.0, -1.0, -2.0, 0.0]]))


def test_credit_rewards_rule():
    mask = torch.tensor([[0, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    # row 0: prompt rewards 1, 2 go to the first action (pos 2); obs reward 4 to pos 2; 6 to pos 4
    # row 1: no action -> everything dropped
    expected = torch.tensor([[0.0, 0.0, 10.0, 0.0, 11.0, 0.0], [0.0] * 6])
    torch.testing.assert_close(credit_rewards(rewards, mask), expected)


def test_length_adaptive_lambda_hand_values():
    mask = torch.zeros(4, 1000, dtype=torch.long)
    mask[1, :10] = 1  # 1 - 1/(0.05*10) = -1 -> clamped to 0
    mask[2, :100] = 1  # 1 - 1/5 = 0.8
    mask[3, :] = 1  # 1 - 1/50 = 0.98
    lam = length_adaptive_lambda(mask, 0.05)
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.8, 0.98]))
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(mask, 0.0)


# --------------------------------------------------------------------------- against naive loops


@pytest.mark.parametrize("seed", range(5))
def test_skip_obs_gae_matches_naive_loop(ragged_batch, seed):
    d = ragged_batch(seed)
    B = d["rewards"].shape[0]
    gamma = [1.0, 0.99, 0.9, 0.5, 0.0][seed]
    for lam in (0.95, torch.rand(B, dtype=torch.float64)):
        lams = lam if isinstance(lam, torch.Tensor) else [lam] * B
        adv, ret = skip_observation_gae(d["rewards"], d["values"], d["action_mask"], gamma, lam)
        ref_adv, ref_ret = naive_skip_obs_gae(d["rewards"], d["values"], d["action_mask"], gamma, lams)
        torch.testing.assert_close(adv, ref_adv)
        torch.testing.assert_close(ret, ref_ret)


@pytest.mark.parametrize("seed", range(3))
def test_mc_returns_is_lambda_one_and_value_free(ragged_batch, seed):
    d = ragged_batch(seed)
    ret = mc_returns(d["rewards"], d["action_mask"], 0.9)
    _, ref = naive_skip_obs_gae(d["rewards"], torch.zeros_like(d["values"]), d["action_mask"], 0.9, [1.0] * 6)
    torch.testing.assert_close(ret, ref)
    _, ret_v = skip_observation_gae(d["rewards"], d["values"], d["action_mask"], 0.9, 1.0)
    torch.testing.assert_close(ret_v, ret)  # with lambda = 1, returns do not depend on V


@pytest.mark.parametrize("seed", range(3))
def test_token_gae_matches_textbook_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 16
    response = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        start, end = 2 + b, T - b  # prompt, contiguous response (actions + observations), padding
        response[b, start:end] = 1
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * response
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = token_gae(rewards, values, response, 0.97, 0.9)
    ref = naive_textbook_gae(rewards, values, response, 0.97, 0.9)
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, (ref + values) * response)


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("seed", range(3))
def test_non_action_values_do_not_move_advantages(ragged_batch, seed):
    d = ragged_batch(seed)
    mask = d["action_mask"].bool()
    adv, ret = skip_observation_gae(d["rewards"], d["values"], mask, 0.99, 0.9)
    scrambled = torch.where(mask, d["values"], torch.randn_like(d["values"]) * 100)
    scrambled[~mask & (torch.rand_like(d["values"]) < 0.2)] = float("nan")
    adv2, ret2 = skip_observation_gae(d["rewards"], scrambled, mask, 0.99, 0.9)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


@pytest.mark.parametrize("seed", range(3))
def test_zero_outside_mask_and_rows_without_actions(ragged_batch, seed):
    d = ragged_batch(seed)
    mask = d["action_mask"].bool()
    adv, ret = skip_observation_gae(d["rewards"], d["values"], mask, 1.0, 0.95)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert not mask[0].any() and torch.all(adv[0] == 0)
    assert torch.isfinite(adv).all()


def test_token_gae_equals_skip_obs_without_observations(ragged_batch):
    d = ragged_batch(0)
    mask = d["action_mask"]
    a1, r1 = token_gae(d["rewards"], d["values"], mask, 0.95, 0.9)
    a2, r2 = skip_observation_gae(d["rewards"], d["values"], mask, 0.95, 0.9)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    # ... and differs once observation tokens join the chain
    a3, _ = token_gae(d["rewards"], d["values"], d["response_mask"], 0.95, 0.9)
    assert not torch.allclose(a3 * mask, a2)


def test_outputs_are_detached_and_dtype_preserved():
    values = torch.randn(2, 5, requires_grad=True)
    adv, ret = skip_observation_gae(torch.ones(2, 5), values, torch.ones(2, 5), 1.0, 0.9)
    assert not adv.requires_grad and not ret.requires_grad and adv.dtype == torch.float32


def test_bad_inputs_name_the_argument():
    ok = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="values"):
        skip_observation_gae(ok, torch.zeros(2, 4), ok, 1.0, 1.0)
    with pytest.raises(ValueError, match="rewards"):
        skip_observation_gae(torch.zeros(6), ok, ok, 1.0, 1.0)
    with pytest.raises(ValueError, match="lam"):
        skip_observation_gae(ok, ok, ok, 1.0, 1.5)
    with pytest.raises(ValueError, match="lam"):
        skip_observation_gae(ok, ok, ok, 1.0, torch.ones(3))
    with pytest.raises(ValueError, match="gamma"):
        skip_observation_gae(ok, ok, ok, -0.1, 1.0)


# --------------------------------------------------------------------------- properties


@st.composite
def small_rows(draw):
    T = draw(st.integers(1, 10))
    mask = draw(st.lists(st.integers(0, 1), min_size=T, max_size=T))
    rewards = draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=T, max_size=T))
    values = draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=T, max_size=T))
    gamma = draw(st.floats(0, 1))
    lam = draw(st.floats(0, 1))
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    return t(rewards), t(values), torch.tensor([mask]), gamma, lam


@settings(max_examples=40, deadline=None)
@given(small_rows())
def test_property_recursion_and_reward_conservation(row):
    rewards, values, mask, gamma, lam = row
    adv, ret = skip_observation_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = naive_skip_obs_gae(rewards, values, mask, gamma, [lam])
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    if mask.any():
        assert math.isclose(credit_rewards(rewards, mask).sum().item(), rewards.sum().item(), abs_tol=1e-9)
        # with gamma = 1 the first action's MC return is the whole episode's reward
        first = int(mask[0].nonzero()[0])
        first_return = mc_returns(rewards, mask, 1.0)[0, first].item()
        assert math.isclose(first_return, rewards.sum().item(), abs_tol=1e-9)
