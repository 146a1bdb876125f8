"""Mismatch diagnostics against a naive per-token loop."""

import math

import pytest
import torch

from saorl.algo.diagnostics import mismatch_metrics


def test_matches_a_naive_loop_per_bucket():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 9
    lp = -torch.rand(B, T, generator=g) * 3
    rlp = -torch.rand(B, T, generator=g) * 3
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    stale = torch.randint(0, 20, (B, T), generator=g)
    lp[mask == 0] = float("nan")  # off-mask garbage is never read
    m = mismatch_metrics(lp, rlp, mask, stale, 0.3, 5.0)
    buckets = {"s0": (0, 0), "s1": (1, 1), "s2_3": (2, 3), "s4_7": (4, 7), "s8_15": (8, 15), "s16+": (16, 99)}
    for name, (lo, hi) in [("", (0, 99)), *((f"_{k}", v) for k, v in buckets.items())]:
        ks, outs = [], []
        for b in range(B):
            for t in range(T):
                if mask[b, t] and lo <= stale[b, t] <= hi:
                    r = math.exp(float(lp[b, t]) - float(rlp[b, t]))
                    ks.append(r - 1 - math.log(r))
                    outs.append(r < 0.7 or r > 6.0)
        if not ks:
            assert f"mismatch/kl{name}" not in m
            continue
        assert m[f"mismatch/kl{name}"] == pytest.approx(sum(ks) / len(ks), rel=1e-9)
        assert m[f"mismatch/outside_band_frac{name}"] == pytest.approx(sum(outs) / len(outs))
        if name:
            assert m[f"mismatch/tokens{name}"] == len(ks)


def test_identical_policies_have_no_mismatch_and_empty_batches_report_nothing():
    lp = torch.tensor([[-1.0, -2.0]])
    m = mismatch_metrics(lp, lp.clone(), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 0.2, 0.2)
    assert m["mismatch/kl"] == 0.0 and m["mismatch/outside_band_frac"] == 0.0
    assert mismatch_metrics(lp, lp, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long), 0.2, 0.2) == {}


def test_advantage_spread_against_a_hand_computed_batch():
    from saorl.algo.diagnostics import advantage_spread

    # row 0: prompt, actions from t=1; row 1: actions from t=2; row 2: actions from t=1;
    # row 3: no action token (left out of both spreads)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([[9.0, 0.5, 0.2, 7.0], [9.0, 9.0, -1.0, 3.0], [9.0, 2.5, 4.0, 1.0], [5.0] * 4])
    rew = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5],
                        [0.0, 0.0, 0.0, 9.0]])
    m = advantage_spread(adv, rew, mask)
    # first-action advantages 0.5, -1.0, 2.5: mean 2/3, population variance
    # ((0.5-2/3)^2 + (-1-2/3)^2 + (2.5-2/3)^2) / 3 = (1/36 + 25/9 + 121/36) / 3 = 37/18
    assert m["adv/first_token_std"] == pytest.approx((37 / 18) ** 0.5)
    # returns 1, 0, 1: mean 2/3, population variance (1/9 + 4/9 + 1/9) / 3 = 2/9
    assert m["adv/return_std"] == pytest.approx((2 / 9) ** 0.5)


def test_advantage_spread_edge_cases():
    from saorl.algo.diagnostics import advantage_spread

    assert advantage_spread(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3)) == {}
    one = advantage_spread(torch.ones(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    assert one == {"adv/first_token_std": 0.0, "adv/return_std": 0.0}


def test_outside_band_weight_share_matches_a_naive_loop_and_is_left_out_without_weight():
    g = torch.Generator().manual_seed(1)
    B, T = 4, 7
    lp = -torch.rand(B, T, generator=g) * 3
    rlp = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    stale = torch.zeros(B, T, dtype=torch.long)
    m = mismatch_metrics(lp, rlp, mask, stale, 0.3, 0.5, advantages=adv)
    out_w = all_w = 0.0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                r = math.exp(float(lp[b, t]) - float(rlp[b, t]))
                w = abs(r * float(adv[b, t]))
                all_w += w
                out_w += w if (r < 0.7 or r > 1.5) else 0.0
    assert 0.0 < out_w < all_w
    assert m["mismatch/outside_band_weight_share"] == pytest.approx(out_w / all_w, rel=1e-9)
    # by hand: ratios e^0 = 1 (kept) and e^1 = 2.72 (outside); weights 1·|2| and 2.72·|1|
    lp2, rlp2 = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -2.0]])
    hand = mismatch_metrics(lp2, rlp2, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 0.2, 0.2,
                            advantages=torch.tensor([[2.0, -1.0]]))
    assert hand["mismatch/outside_band_weight_share"] == pytest.approx(math.e / (2 + math.e))
    none = mismatch_metrics(lp2, rlp2, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 0.2, 0.2,
                            advantages=torch.zeros(1, 2))
    assert "mismatch/outside_band_weight_share" not in none
    assert "mismatch/outside_band_weight_share" not in mismatch_metrics(
        lp2, rlp2, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 0.2, 0.2)
