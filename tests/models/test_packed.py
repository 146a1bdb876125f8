"""Packed rows: the varlen attention equals each sequence run alone, for both tiny families."""

import random

import pytest
import torch

from saorl.models.critic import Critic
from saorl.models.logprobs import token_logprobs
from saorl.models.packed import VARLEN, model_inputs, use_varlen_attention
from saorl.models.tiny import build_tiny

LENGTHS = [5, 17, 1, 9, 17, 2, 30]  # repeats (batched together), a one-token sequence


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def kind(request):
    return request.param


def _seqs(seed=0):
    rng = random.Random(seed)
    return [[rng.randint(2, 1000) for _ in range(n)] for n in LENGTHS]


def _packed(seqs):
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.tensor([[j for s in seqs for j in range(len(s))]])
    cu = torch.tensor([0, *map(len, seqs)]).cumsum(0).to(torch.int32)
    return ids, pos, cu


def _solo_logits(model, seqs):
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in seqs])


@pytest.mark.parametrize("impl", [VARLEN, "sdpa", "eager"])
def test_packed_row_equals_each_sequence_alone(kind, impl):
    model = build_tiny(kind, seed=0)
    seqs = _seqs()
    ref = _solo_logits(model, seqs)
    model.set_attn_implementation(impl)
    ids, pos, cu = _packed(seqs)
    kw, scored = model_inputs(ids, None, pos, cu)
    with torch.no_grad():
        out = model(**kw).logits[0]
        no_cu = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # boundaries from positions
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert torch.allclose(no_cu, ref, atol=1e-5)
    starts = set(cu[:-1].tolist())
    assert scored[0].tolist() == [j not in starts for j in range(ids.shape[1])]


def test_varlen_gradients_equal_the_block_mask(kind):
    seqs = _seqs(1)
    ids, pos, cu = _packed(seqs)
    grads = {}
    for impl in ("sdpa", VARLEN):
        model = build_tiny(kind, seed=0).train()
        model.set_attn_implementation(impl)
        kw, _ = model_inputs(ids, None, pos, cu)
        model(**kw).logits.square().mean().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads[VARLEN].keys()
    for n, g in grads["sdpa"].items():
        assert torch.allclose(g, grads[VARLEN][n], atol=1e-6), n


def test_varlen_leaves_padded_and_cached_calls_unchanged(kind):
    ref, model = build_tiny(kind, seed=0), build_tiny(kind, seed=0)
    assert use_varlen_attention(model) and model.config._attn_implementation == VARLEN
    assert not use_varlen_attention(model)  # only sdpa is switched
    ids = torch.tensor([[1, 1, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask, position_ids=pos).logits for m in (ref, model)]
        gen = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          pad_token_id=1) for m in (ref, model)]
        plain = [m(input_ids=ids[1:]).logits for m in (ref, model)]  # no mask at all: causal
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(gen[0], gen[1])
    assert torch.allclose(plain[0], plain[1], atol=1e-6)


def test_token_logprobs_and_critic_packed_equal_padded(kind):
    model = build_tiny(kind, seed=0)
    critic = Critic.from_policy(model)
    use_varlen_attention(model)
    use_varlen_attention(critic.trunk)
    seqs = _seqs(2)
    ids, pos, cu = _packed(seqs)
    width = max(LENGTHS)
    pad_ids = torch.tensor([s + [1] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        lp_pad, ent_pad = token_logprobs(model, pad_ids, mask, temperature=0.7, top_k=50, return_entropy=True)
        lp, ent = token_logprobs(model, ids, None, temperature=0.7, top_k=50, return_entropy=True,
                                 position_ids=pos, cu_seqlens=cu)
        v_pad, v = critic(pad_ids, mask), critic(ids, None, position_ids=pos, cu_seqlens=cu)
    for packed, padded in ((lp, lp_pad), (ent, ent_pad), (v, v_pad)):
        flat = torch.cat([padded[i, :n] for i, n in enumerate(LENGTHS)])
        assert torch.allclose(packed[0], flat, atol=1e-5)
    assert float(lp[0, 0]) == 0.0 and float(v[0, int(cu[3])]) == 0.0  # a sequence's first token: unscored


def test_malformed_packed_inputs_are_rejected():
    model = build_tiny("tiny-dense", seed=0)
    ids, pos, cu = _packed(_seqs())
    with pytest.raises(ValueError, match="position_ids and cu_seqlens"):
        token_logprobs(model, ids, None)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        token_logprobs(model, ids, None, position_ids=pos, cu_seqlens=cu[:-1])
    with pytest.raises(ValueError, match="one row"):
        token_logprobs(model, ids.expand(2, -1), None, position_ids=pos.expand(2, -1), cu_seqlens=cu)


@pytest.mark.parametrize("impl", [VARLEN, "sdpa"])
def test_a_packed_row_keeps_each_sequences_sliding_window(impl):
    """Gemma 3's sliding-window layers (a 4-token window here, so it binds): packed, each sequence
    attends within its own window as it does alone; the window is the model's mask, not varlen's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=4,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    seqs = _seqs()
    ref = _solo_logits(model, seqs)
    model.set_attn_implementation(impl)
    ids, pos, cu = _packed(seqs)
    kw, _ = model_inputs(ids, None, pos, cu)
    with torch.no_grad():
        assert torch.allclose(model(**kw).logits[0], ref, atol=1e-5)
        model.config.sliding_window = 10**4  # the window binds: without it the logits differ
        assert not torch.allclose(model(**kw).logits[0], ref, atol=1e-3)
