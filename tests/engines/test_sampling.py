import math

import pytest
import torch

from saorl.engines.sampling import filtered_logprobs, sample_rows
from tests.engines.conftest import naive


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.8), (2.0, 1, 0.3)])
def test_filtered_logprobs_match_naive_loop(t, k, p):
    logits = torch.randn(3, 12)
    got = filtered_logprobs(logits, torch.full((3,), t), torch.full((3,), k), torch.full((3,), p))
    for row in range(3):
        ref = torch.tensor(naive(logits[row], t, k, p), dtype=torch.float32)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(ref))
        finite = ~torch.isinf(ref)
        assert torch.allclose(got[row][finite], ref[finite], atol=1e-5)
        assert math.isclose(float(got[row].exp().sum()), 1.0, rel_tol=1e-5)


def test_hand_computed_top_p():
    # probs 0.5, 0.3, 0.2: top_p = 0.6 keeps the first two (mass before the 2nd is 0.5 < 0.6)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    lp = filtered_logprobs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.6]))
    assert torch.allclose(lp.exp(), torch.tensor([[0.625, 0.375, 0.0]]), atol=1e-6)


def test_sampling_frequencies_follow_filtered_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    gen = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        tok, lp = sample_rows(logits[None], torch.ones(1), torch.tensor([3]), torch.ones(1), [gen])
        counts[tok] += 1
        assert math.isclose(float(lp), math.log([0.4, 0.3, 0.2][int(tok)] / 0.9), rel_tol=1e-5)
    assert counts[3] == 0
    assert torch.allclose(counts[:3] / n, torch.tensor([4, 3, 2]) / 9, atol=0.03)


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(3, 10)
    temp = torch.tensor([0.0, 1.0, 0.0])
    gens = [None, torch.Generator().manual_seed(1), None]
    tok, lp = sample_rows(logits, temp, torch.zeros(3, dtype=torch.long), torch.ones(3), gens)
    ls = torch.log_softmax(logits, -1)
    for r in (0, 2):
        assert tok[r] == logits[r].argmax() and math.isclose(float(lp[r]), float(ls[r].max()), rel_tol=1e-6)
    assert math.isclose(float(lp[1]), float(ls[1, tok[1]]), rel_tol=1e-5)


def test_edge_rows_hand_computed():
    from saorl.models.truncation import edge_rows

    # probs 0.5, 0.45, 0.05: at top_p 0.95 the third token's mass before is exactly 0.95 (an edge);
    # at top_p 0.9 no token's is within 1e-6 of it
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05], [0.5, 0.3, 0.2]], dtype=torch.float64)).float()
    assert edge_rows(logits, 0, 0.95).tolist() == [True, False]
    assert edge_rows(logits, 0, 0.9).tolist() == [False, False]
    assert edge_rows(logits, 0, 1.0).tolist() == [False, False]
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0], [2.0, 1.0, 0.5, 0.0]])  # the 2nd and 3rd tie at k=2
    assert edge_rows(tied, 2, 1.0).tolist() == [True, False]
    assert edge_rows(tied, 3, 1.0).tolist() == [False, False]
