import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from saorl.models.loading import load_policy
from saorl.models.logprobs import token_logprobs

PAD = 1


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def model(request):
    return load_policy(request.param, seed=0)


def _naive(model, ids, temperature):
    """Per position: run the prefix alone, log_softmax of the last logits."""
    out = [0.0]
    with torch.no_grad():
        for t in range(1, len(ids)):
            logits = model(torch.tensor([ids[:t]])).logits[0, -1].double() / temperature
            out.append(torch.log_softmax(logits, -1)[ids[t]].item())
    return torch.tensor(out, dtype=torch.float64)


def _right_pad(seqs):
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), PAD)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def test_matches_naive_loop_with_right_padding(model):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (9, 5, 7)]
    ids, mask = _right_pad(seqs)
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=0.7)
    assert lp.shape == ids.shape and lp.dtype == torch.float32
    for i, s in enumerate(seqs):
        ref = _naive(model, s, 0.7)
        torch.testing.assert_close(lp[i, : len(s)].double(), ref, atol=1e-5, rtol=0)
        assert torch.all(lp[i, len(s):] == 0)


def test_padding_invariance_right_and_left(model):
    g = torch.Generator().manual_seed(2)
    a = torch.randint(2, 1024, (6,), generator=g).tolist()
    b = torch.randint(2, 1024, (10,), generator=g).tolist()
    with torch.no_grad():
        alone = token_logprobs(model, torch.tensor([a]), torch.ones(1, 6, dtype=torch.long))[0]
        ids, mask = _right_pad([a, b])
        right = token_logprobs(model, ids, mask)
        left_ids = torch.cat([torch.full((4,), PAD), torch.tensor(a)])[None]
        left_mask = torch.cat([torch.zeros(4), torch.ones(6)]).long()[None]
        left = token_logprobs(model, left_ids, left_mask)
    assert torch.allclose(right[0, :6], alone, atol=1e-5)
    assert torch.all(right[0, 6:] == 0) and alone[0] == 0
    assert torch.allclose(left[0, 4:], alone, atol=1e-5)
    assert torch.all(left[0, :4] == 0)


class _FixedLogits(nn.Module):
    """A stand-in LM whose logits are [2, 1, 0] at every position (vocab 3)."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        B, T = input_ids.shape
        return SimpleNamespace(logits=torch.tensor([2.0, 1.0, 0.0]).expand(B, T, 3))


def test_temperature_against_hand_computation():
    ids, mask = torch.tensor([[0, 0, 1, 2]]), torch.ones(1, 4, dtype=torch.long)
    lp, ent = token_logprobs(_FixedLogits(), ids, mask, temperature=2.0, return_entropy=True)
    # logits / 2 = [1, 0.5, 0]; Z = e + e^0.5 + 1
    z = math.e + math.exp(0.5) + 1
    expect = [0.0, 1 - math.log(z), 0.5 - math.log(z), -math.log(z)]
    assert torch.allclose(lp[0], torch.tensor(expect), atol=1e-6)
    p = [math.e / z, math.exp(0.5) / z, 1 / z]
    h = -sum(pi * math.log(pi) for pi in p)
    assert torch.allclose(ent[0], torch.tensor([0.0, h, h, h]), atol=1e-6)
    greedy = token_logprobs(_FixedLogits(), ids, mask, temperature=0.0)
    one = token_logprobs(_FixedLogits(), ids, mask, temperature=1.0)
    z1 = math.e**2 + math.e + 1
    assert torch.equal(greedy, one)
    assert torch.allclose(one[0, 1], torch.tensor(2 - math.log(z1)), atol=1e-6)


def test_entropy_matches_naive_and_gradients_flow():
    model = load_policy("tiny-dense")
    ids = torch.randint(2, 1024, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    lp, ent = token_logprobs(model, ids, mask, return_entropy=True)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)
    naive = -(logp.exp() * logp).sum(-1)[:, :-1].float()
    assert torch.allclose(ent[0, 1:], naive[0], atol=1e-5)
    assert torch.allclose(ent[1, 1:3], naive[1, :2], atol=1e-5) and torch.all(ent[1, 3:] == 0)
    lp.sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_bad_input_errors():
    model = _FixedLogits()
    with pytest.raises(ValueError, match="attention_mask shape"):
        token_logprobs(model, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_logprobs(model, torch.zeros(3, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), temperature=-1)


@pytest.mark.parametrize("kind", ["tiny-moe", "tiny-dense"])
def test_truncated_scoring_matches_the_engines_sampled_logprobs(kind):
    """DIS needs the trainer's log-prob of each sampled token under the distribution the engine
    sampled from: with top_k / top_p, the truncated and renormalised one."""
    from saorl.engines.base import SamplingParams
    from saorl.engines.local import LocalEngine
    from saorl.models.tokenizer import load_tokenizer

    model = load_policy(kind, seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=24, seed=5)
    prompts = [[5 + i, 40, 41 + 3 * i, 7] for i in range(4)]
    with LocalEngine(model, load_tokenizer(), max_batch_size=4, stop_on_eos=False) as engine:
        results = engine.generate(prompts, params)
    seqs = [p + r.token_ids for p, r in zip(prompts, results)]
    ids, mask = _right_pad(seqs)
    with torch.no_grad():
        truncated = token_logprobs(model, ids, mask, temperature=0.8, top_k=20, top_p=0.9)
        plain = token_logprobs(model, ids, mask, temperature=0.8)
    worst, worst_plain = 0.0, 0.0
    for b, (p, r) in enumerate(zip(prompts, results)):
        engine_lp = torch.tensor(r.logprobs)
        span = slice(len(p), len(p) + len(r.token_ids))
        worst = max(worst, (truncated[b, span] - engine_lp).abs().max().item())
        worst_plain = max(worst_plain, (plain[b, span] - engine_lp).abs().max().item())
    assert worst < 1e-4
    assert worst_plain > 1e-2  # without the truncation the ratio would be biased


def test_tokens_outside_the_truncation_get_the_floor_and_no_gradient():
    from saorl.models.logprobs import LOGPROB_FLOOR

    model = load_policy("tiny-dense", seed=0)
    ids, mask = _right_pad([[5, 6, 7, 8, 9, 10]])
    lp = token_logprobs(model, ids, mask, top_k=1)  # greedy kept set: these tokens are not in it
    picked_greedy = model(ids).logits[0, :-1].argmax(-1)
    outside = picked_greedy != ids[0, 1:]
    assert bool(outside.any())
    assert torch.all(lp[0, 1:][outside] == LOGPROB_FLOOR)
    lp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
