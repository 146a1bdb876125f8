"""A packed row holding a shared prefix once: each sequence's logits, log-probs and values equal the
sequence run alone, gradients equal the plain packed row's, and malformed layouts or an attention
that would not read the layout are refused."""

import random

import pytest
import torch

from saorl.data.batch import collate
from saorl.data.packing import MIN_SHARED_PREFIX, microbatches, shared_prefix_len
from saorl.data.trajectory import Trajectory
from saorl.models.critic import Critic
from saorl.models.logprobs import token_logprobs
from saorl.models.packed import VARLEN, model_inputs, use_varlen_attention, varlen_attention
from saorl.models.tiny import build_tiny

P = 20
TAILS = [5, 9, 5, 1, 13]  # two of one length (one sdpa call), a one-token suffix


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def kind(request):
    return request.param


def _seqs(seed=0):
    rng = random.Random(seed)
    prefix = [rng.randint(2, 1000) for _ in range(P)]
    return [prefix + [rng.randint(2, 1000) for _ in range(n)] for n in TAILS]


def _plain(seqs):
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.tensor([[j for s in seqs for j in range(len(s))]])
    return ids, pos, torch.tensor([0, *map(len, seqs)]).cumsum(0).to(torch.int32)


def _shared(seqs):
    parts = [seqs[0][:P]] + [s[P:] for s in seqs]
    ids = torch.tensor([[t for s in parts for t in s]])
    pos = torch.tensor([list(range(P)) + [j for s in seqs for j in range(P, len(s))]])
    return ids, pos, torch.tensor([0, *map(len, parts)]).cumsum(0).to(torch.int32)


def _suffixes(row, seqs, shared):
    """Each sequence's positions P+1.. (those a shared row scores) out of a ``[1, N]`` result."""
    out, off = [], P if shared else 0
    for s in seqs:
        start = off if shared else off + P
        out.append(row[0, start + 1:start + len(s) - P])
        off += len(s) - P if shared else len(s)
    return torch.cat(out)


def test_each_suffix_sees_exactly_its_own_sequence(kind):
    model = build_tiny(kind, seed=0)
    seqs = _seqs()
    with torch.no_grad():
        solo = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0, P:-1] for s in seqs])
        use_varlen_attention(model)
        ids, pos, cu = _shared(seqs)
        kw, scored = model_inputs(ids, None, pos, cu)
        logits = model(**kw).logits
    assert kw["shared_prefix_len"] == P
    # logits at a suffix position predict its next token: row positions P+start .. end-2
    mine, off = [], P
    for s in seqs:
        mine.append(logits[0, off:off + len(s) - P - 1])
        off += len(s) - P
    torch.testing.assert_close(torch.cat(mine), solo, atol=1e-5, rtol=1e-5)
    starts = set(cu[:-1].tolist())
    assert scored[0].tolist() == [j not in starts for j in range(ids.shape[1])]


def test_log_probs_values_and_gradients_equal_the_plain_packed_row(kind):
    seqs = _seqs(1)
    out = {}
    for layout in ("plain", "shared"):
        policy = build_tiny(kind, seed=0).train()
        critic = Critic.from_policy(build_tiny(kind, seed=0), seed=0)
        use_varlen_attention(policy)
        use_varlen_attention(critic.trunk)
        ids, pos, cu = _shared(seqs) if layout == "shared" else _plain(seqs)
        lp = token_logprobs(policy, ids, None, temperature=0.7, position_ids=pos, cu_seqlens=cu)
        v = critic(ids, None, position_ids=pos, cu_seqlens=cu)
        lp, v = _suffixes(lp, seqs, layout == "shared"), _suffixes(v, seqs, layout == "shared")
        (lp.sum() + v.square().sum()).backward()
        out[layout] = lp.detach(), v.detach(), {n: p.grad for n, p in policy.named_parameters()}
    (lp0, v0, g0), (lp1, v1, g1) = out["plain"], out["shared"]
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    assert g0.keys() == g1.keys()
    for n, g in g0.items():
        torch.testing.assert_close(g1[n], g, atol=1e-5, rtol=1e-5, msg=n)
    # the prefix's embedding rows get their gradient from every suffix (not just the first's)
    assert float(g0["model.embed_tokens.weight"][seqs[0][0]].abs().sum()) > 0


def test_layouts_and_attentions_that_cannot_share_are_refused():
    seqs = _seqs()
    ids, pos, cu = _shared(seqs)
    bad = pos.clone()
    bad[0, int(cu[2])] = P + 1  # the second suffix continues from P + 1, not from P
    with pytest.raises(ValueError, match="every one after the first at 20"):
        model_inputs(ids, None, bad, cu)
    model = build_tiny("tiny-dense", seed=0)
    for impl in ("sdpa", "eager"):  # they would read the suffixes as sequences of their own
        model.set_attn_implementation(impl)
        with pytest.raises(ValueError, match="needs the 'sdpa_varlen' attention"):
            token_logprobs(model, ids, None, position_ids=pos, cu_seqlens=cu)
        with pytest.raises(ValueError, match="needs the 'sdpa_varlen' attention"):
            Critic.from_policy(model)(ids, None, position_ids=pos, cu_seqlens=cu)
    model.set_attn_implementation(VARLEN)
    assert token_logprobs(model, ids, None, position_ids=pos, cu_seqlens=cu).shape == ids.shape
    # a model that drops the kwargs: the attention sees only position ids, whose later suffixes
    # start at P; read as sequences of their own, they would not see the prefix: refused
    q = torch.randn(1, 2, ids.shape[1], 8)
    with pytest.raises(ValueError, match=f"restart at positions \\[{P}, {P}"):
        varlen_attention(model, q, q, q, None, position_ids=pos)
    plain_ids, plain_pos, _ = _plain(seqs)  # a plain packed row restarts at 0: read by position ids
    q = torch.randn(1, 2, plain_ids.shape[1], 8)
    out, _ = varlen_attention(model, q, q, q, None, position_ids=plain_pos)
    assert out.shape == (1, plain_ids.shape[1], 2, 8)


def _traj(ids, prompt_len):
    n = len(ids)
    mask = [0] * prompt_len + [1] * (n - prompt_len)
    return Trajectory(ids, mask, [-1.0 * m for m in mask], [0.0] * n, [0 if m else -1 for m in mask],
                      prompt_len)


def test_the_shared_prefix_stops_before_any_response_and_every_token_is_still_seen_once():
    rng = random.Random(5)
    system = [rng.randint(2, 500) for _ in range(30)]
    trajs = [_traj(system + [rng.randint(2, 500) for _ in range(n)], 30 + k)
             for n, k in ((12, 3), (4, 2), (20, 5), (7, 1))]
    batch = collate(trajs, 1)
    assert shared_prefix_len(batch) == 30  # the common 30 tokens; the earliest response at 31
    trajs[3] = _traj(trajs[3].token_ids, 25)  # a row whose response starts inside the common tokens
    batch = collate(trajs, 1)
    assert shared_prefix_len(batch) == 24
    micro = microbatches(batch, 60, shared_prefix=True)  # suffixes of 18, 10, 26, 13 in 36: two rows
    assert sorted(len(mb.rows) for mb in micro) == [2, 2]
    seen = torch.zeros_like(batch.attention_mask)
    for mb in micro:
        assert mb.cu_seqlens[1] == 24 and mb.position_ids[0, :24].tolist() == list(range(24))
        assert mb.positions <= 60
        assert torch.equal(mb.gather(batch.input_ids), mb.input_ids)
        seen[mb.row_index, mb.col_index] += 1
    only_prefix = seen[:, :24].sum(0)  # the prefix once per row, the rest of every row exactly once
    assert only_prefix.tolist() == [len(micro)] * 24
    assert bool((seen[:, 24:] == batch.attention_mask[:, 24:]).all())
    saved = 24 * (len(trajs) - len(micro))
    assert sum(mb.positions for mb in micro) == int(batch.attention_mask.sum()) - saved
    short = collate([_traj([*system[:MIN_SHARED_PREFIX - 1], 5, 6], MIN_SHARED_PREFIX)] * 3, 1)
    plain = microbatches(short, 60, shared_prefix=True)  # too short a prefix to be worth sharing
    assert all(not mb.position_ids[0, int(mb.cu_seqlens[1])] for mb in plain)
    alone = microbatches(batch, 30, shared_prefix=True)  # every suffix alone: no row to share with
    assert len(alone) == 4 and all(mb.cu_seqlens.tolist() == [0, mb.positions] for mb in alone)
    assert shared_prefix_len(collate(trajs[:1], 1)) == 0  # one row shares nothing
