"""Token-budget micro-batches: every token exactly once, budgets kept, gather/scatter round trips."""

import random

import pytest
import torch

from saorl.data.batch import BatchError, collate
from saorl.data.packing import idle_microbatch, microbatches, plan_packed, plan_padded
from saorl.data.trajectory import Trajectory

PAD = 1


def _trajs(lengths, seed=0):
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        p = min(2, n - 1)
        ids = [rng.randint(2, 500) for _ in range(n)]
        mask = [0] * p + [1] * (n - p)
        versions = [0 if m else -1 for m in mask]
        out.append(Trajectory(ids, mask, [-1.0 * m for m in mask], [0.0] * n, versions, p, task_id=f"t{i}"))
    return out


@pytest.mark.parametrize("plan", [plan_packed, plan_padded])
def test_plans_cover_every_row_once_within_budget(plan):
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 20))]
        budget = rng.randint(10, 200)
        bins = plan(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        for b in bins:
            cost = sum(lengths[i] for i in b) if plan is plan_packed else len(b) * max(lengths[i] for i in b)
            assert cost <= budget or len(b) == 1  # only a lone trajectory may exceed the budget


def test_first_fit_decreasing_fills_rows():
    assert plan_packed([5, 3, 7, 2, 4], 10) == [[2, 1], [0, 4], [3]]
    assert plan_packed([11, 3], 10) == [[0], [1]]  # longer than the budget: alone, never cut
    assert plan_padded([5, 3, 7, 2, 4], 12) == [[2], [0, 4], [1, 3]]


@pytest.mark.parametrize("packed", [True, False])
def test_gather_scatter_round_trip_and_layout(packed):
    trajs = _trajs([7, 3, 12, 5, 1 + 1, 9])
    batch = collate(trajs, PAD)
    micro = microbatches(batch, 16, packed=packed)
    seen = torch.zeros_like(batch.attention_mask)
    rebuilt = torch.full_like(batch.input_ids, -7)
    for mb in micro:
        assert mb.packed == packed
        assert mb.positions <= 16 or len(mb.rows) == 1
        ids = mb.gather(batch.input_ids)
        assert torch.equal(ids, mb.input_ids)
        mb.scatter(ids, rebuilt)
        if packed:
            assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
            lens = [len(trajs[r]) for r in mb.rows]
            assert mb.cu_seqlens.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
            assert mb.position_ids[0].tolist() == [j for n in lens for j in range(n)]
            for r, s, n in zip(mb.rows, mb.cu_seqlens[:-1].tolist(), lens):
                assert mb.input_ids[0, s:s + n].tolist() == trajs[r].token_ids
            seen[mb.row_index, mb.col_index] += 1
        else:
            assert torch.equal(mb.attention_mask, batch.attention_mask[mb.rows, :mb.input_ids.shape[1]])
            seen[mb.row_index, mb.col_index] += mb.attention_mask
    assert torch.equal(seen, batch.attention_mask)  # every real token exactly once
    real = batch.attention_mask.bool()
    assert torch.equal(rebuilt[real], batch.input_ids[real])
    if packed:
        assert sum(mb.positions for mb in micro) == int(batch.attention_mask.sum())  # no padding at all


def test_bad_budget_is_rejected():
    batch = collate(_trajs([3, 4]), PAD)
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(BatchError, match="max_tokens"):
            microbatches(batch, bad)


@pytest.mark.parametrize("packed", [True, False])
def test_an_idle_micro_batch_gathers_zeros_scatters_nothing_and_its_loss_is_zero(packed):
    from saorl.algo.losses import masked_mean
    from saorl.models.logprobs import token_logprobs
    from saorl.models.tiny import build_tiny

    batch = collate(_trajs([5, 9]), PAD)
    idle = idle_microbatch(PAD, "cpu", packed)
    assert idle.rows == [] and idle.packed == packed and idle.input_ids.tolist() == [[PAD, PAD]]
    routes = torch.arange(2 * 9 * 6).reshape(2, 9, 6)
    assert torch.equal(idle.gather(routes), torch.zeros(1, 2, 6, dtype=routes.dtype))
    assert torch.equal(idle.gather(batch.action_mask), torch.zeros(1, 2, dtype=batch.action_mask.dtype))
    out = torch.ones(2, 9)
    idle.scatter(torch.full((1, 2), 7.0), out)
    assert torch.equal(out, torch.ones(2, 9))
    # a loss on it, as the learners weight one: exactly 0, with finite gradients (all 0) through the model
    model = build_tiny("tiny-dense", seed=0)
    lp = token_logprobs(model, idle.input_ids, **idle.model_args())
    loss = masked_mean(lp, idle.gather(batch.action_mask))
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)
