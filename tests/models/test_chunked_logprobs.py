"""The chunked vocabulary projection and log-softmax of :func:`saorl.models.logprobs.token_logprobs`
equal the plain ones: log-probabilities, entropies and the gradients they send to every parameter,
in the padded and the packed layout, with temperature and top-k / top-p truncation."""

from __future__ import annotations

import pytest
import torch

import saorl.models.logprobs as lp
from saorl.data.batch import collate
from saorl.data.packing import microbatches
from saorl.data.trajectory import Trajectory
from saorl.models.tiny import build_tiny


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for length in (9, 14, 5, 12):
        ids = torch.randint(2, 1000, (length,), generator=g).tolist()
        trajs.append(Trajectory(token_ids=ids, action_mask=[0, 0] + [1] * (length - 2),
                                rollout_logprobs=[0.0] * length, rewards=[0.0] * length,
                                versions=[0] * length, prompt_len=2))
    return collate(trajs, 1)


def _run(model, inputs: dict, chunk_bytes: int, monkeypatch, **kw):
    monkeypatch.setattr(lp, "LOGITS_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(lp, "CHUNK_ABOVE_BYTES", chunk_bytes)
    model.zero_grad(set_to_none=True)
    logprobs, entropy = lp.token_logprobs(model, return_entropy=True, **inputs, **kw)
    (logprobs.sum() + 0.3 * entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"top_k": 20, "top_p": 0.9}])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_chunked_equals_plain(kw, layout, monkeypatch):
    model = build_tiny("tiny-dense", seed=0).float()
    batch = _batch()
    if layout == "padded":
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    else:
        mb = microbatches(batch, 4096, True)[0]
        inputs = {"input_ids": mb.input_ids, **mb.model_args()}
    vocab = model.config.vocab_size
    positions = inputs["input_ids"].numel()
    plain = _run(model, inputs, 10**15, monkeypatch, **kw)  # never chunked
    seen = []
    real = lp.chunked_logprobs
    monkeypatch.setattr(lp, "chunked_logprobs", lambda *a, **k: seen.append(1) or real(*a, **k))
    chunked = _run(model, inputs, 4 * vocab * 3, monkeypatch, **kw)  # chunks of 3 positions
    assert seen and positions > 3, "the chunked path did not run"
    for a, b in zip(plain[:2], chunked[:2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert plain[2].keys() == chunked[2].keys() and plain[2]
    assert all(torch.isfinite(g).all() for g in plain[2].values()), "a non-finite gradient"
    for name, g in plain[2].items():
        torch.testing.assert_close(chunked[2][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_a_head_that_is_more_than_a_projection_is_not_chunked(monkeypatch):
    model = build_tiny("tiny-dense", seed=0)
    model.config.final_logit_softcapping = 30.0
    assert lp.decoder_and_head(model) is None
    model.config.final_logit_softcapping = None
    decoder, head = lp.decoder_and_head(model)
    assert decoder is model.get_decoder() and head is model.get_output_embeddings()
