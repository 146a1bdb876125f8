import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.algo.advantages import RunningMeanBaseline, broadcast_to_tokens, grpo_advantages


def test_grpo_hand_case():
    scores = torch.tensor([1.0, 0.0, 2.0, 3.0, 5.0, 10.0])
    groups = torch.tensor([2, 2, 2, 9, 9, 4])  # ids need not be contiguous or sorted
    mask = torch.ones(6, 3, dtype=torch.long)
    mask[:, 2] = 0
    adv = grpo_advantages(scores, groups, mask, eps=0.0)
    # group 2: mean 1, unbiased std 1 -> 0, -1, 1; group 9: mean 4, std sqrt(2); group 4 (singleton) -> 0
    s = 1 / math.sqrt(2)
    expected = torch.tensor([0.0, -1.0, 1.0, -s, s, 0.0])
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(adv[:, 1], expected)
    assert torch.all(adv[:, 2] == 0)
    centred = grpo_advantages(scores, groups, mask, normalize_std=False)
    torch.testing.assert_close(centred[:, 0], torch.tensor([0.0, -1.0, 1.0, -1.0, 1.0, 0.0]))


def test_grpo_constant_group_is_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), torch.ones(3, 2), eps=0.0)
    assert torch.all(adv == 0)


def test_grpo_rejects_bad_inputs():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="shape"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.ones(3, 2))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-10, 10)), min_size=1, max_size=16))
def test_property_grpo_zero_group_mean_and_unit_std(rows):
    groups = torch.tensor([g for g, _ in rows])
    scores = torch.tensor([s for _, s in rows], dtype=torch.float64)
    adv = grpo_advantages(scores, groups, torch.ones(len(rows), 1))[:, 0]
    for g in groups.unique():
        a = adv[groups == g]
        assert abs(a.mean().item()) < 1e-6
        spread = scores[groups == g]
        if len(a) > 1 and spread.std().item() > 1e-3:
            assert a.std().item() == pytest.approx(1.0, rel=1e-3)


def test_running_mean_baseline_semantics():
    b = RunningMeanBaseline(momentum=0.5)
    # first batch: no baseline yet -> its own mean (2); baseline becomes 2
    torch.testing.assert_close(b.update(torch.tensor([1.0, 3.0])), torch.tensor([-1.0, 1.0]))
    assert b.value == 2.0
    # against the baseline *before* this batch: 4 - 2; then b = 0.5*2 + 0.5*4 = 3
    torch.testing.assert_close(b.update(torch.tensor([4.0])), torch.tensor([2.0]))
    assert b.value == 3.0
    torch.testing.assert_close(b.update(torch.tensor([3.0, 5.0])), torch.tensor([0.0, 2.0]))
    assert b.value == 3.5 and b.num_updates == 3

    restored = RunningMeanBaseline(momentum=0.9)
    restored.load_state_dict(b.state_dict())
    assert restored.state_dict() == b.state_dict()
    torch.testing.assert_close(restored.update(torch.tensor([4.5])), b.update(torch.tensor([4.5])))


def test_running_mean_baseline_init_and_errors():
    b = RunningMeanBaseline(momentum=0.0, init=1.0)
    torch.testing.assert_close(b.update(torch.tensor([1.0, 2.0])), torch.tensor([0.0, 1.0]))
    assert b.value == 1.5  # momentum 0 -> the last batch mean
    with pytest.raises(ValueError, match="momentum"):
        RunningMeanBaseline(momentum=1.0)
    with pytest.raises(ValueError, match="scores"):
        b.update(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"value": 1.0})


def test_broadcast_to_tokens():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 2.0, 0.0], [-1.0, 0, 0, 0], [0.0, 0, 0, 0]]))
    assert broadcast_to_tokens(torch.tensor([1, 2, 3]), mask).dtype == torch.float32
    with pytest.raises(ValueError, match="adv"):
        broadcast_to_tokens(torch.zeros(2), mask)
