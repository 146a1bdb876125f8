"""Per-token log-probabilities (and entropies) of a sequence under a causal LM.

``logprobs[:, t] = log softmax(logits[:, t-1] / temperature)[x_t]``, i.e. log p(x_t | x_<t) — the
quantity the rollout engine records as ``rollout_logprobs[t]`` and the DIS ratio compares against.

Layouts (:func:`saorl.models.packed.model_inputs`). Padded ``[B, T]`` with an attention mask:
position ids are derived from the mask (``cumsum(mask) - 1``), so right padding (what
``saorl.data`` collate produces) and left padding both work; a token is scored only when it and
the token before it are real (``mask[t] = 1`` and ``mask[t-1] = 1``); every other position holds
0 — position 0, the first real token of a left-padded row, and all padding. Masks with holes
(padding between real tokens) are not supported. Packed ``[1, N]`` (several sequences end to end,
``attention_mask=None``, per-sequence ``position_ids`` and ``cu_seqlens``): a token is scored when
its position id is > 0, i.e. the token before it belongs to the same sequence.

Truncation. An engine that samples with top-k / top-p records the log-probability under the
*truncated*, renormalised distribution; ``top_k`` / ``top_p`` here score under the same
truncation of the model's own distribution (the kept set is recomputed from these logits, as
the engine computed it from its own), so a DIS ratio compares like with like. A token outside
the kept set has probability 0: its log-probability is ``LOGPROB_FLOOR`` (``exp`` of it is 0, its
gradient 0), never ``-inf``.

Memory. The log-probability is ``x_t``'s logit minus the row's logsumexp (``[B, T]`` results), not a
gathered full ``log_softmax``. When the float32 logits of the whole input would exceed
:data:`CHUNK_ABOVE_BYTES` (a real vocabulary: SmolLM2's 49,152 entries over 4,096 positions are 805 MB)
and the model is a plain decoder under an output projection (``get_decoder()`` and
``get_output_embeddings()``, no logit soft-capping or scaling), the projection, log-softmax and
entropy run on chunks of positions under activation checkpointing: one chunk's ``[n, V]`` logits are
alive at a time, in the forward and again in the backward, which recomputes them. Per position the
arithmetic is the same; only the matrix products' blocking differs (float rounding). Otherwise
(small vocabularies, other heads) the model's own ``[B, T, V]`` logits are used: a temperature other
than 1 and a low-precision model each cost one scaled/upcast copy, the entropy one softmax.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from saorl.models.packed import model_inputs, require_shared_prefix_support
from saorl.models.truncation import filtered_logprobs

LOGPROB_FLOOR = -1e4
"""The log-probability of a token outside the truncated distribution (probability 0)."""


def truncation_mask(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """``[..., V]`` bool: the tokens top-k then top-p keep of each (tempered) row, as the engine's
    sampler keeps them (:func:`saorl.models.truncation.filtered_logprobs`)."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    n = flat.shape[0]
    ones = flat.new_ones(n)
    kept = filtered_logprobs(flat, ones, torch.full((n,), int(top_k), device=flat.device),
                             torch.full((n,), float(top_p), device=flat.device)) > float("-inf")
    return kept.reshape(logits.shape)


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, temperature: float = 1.0,
    return_entropy: bool = False, top_k: int = 0, top_p: float = 1.0, *,
    position_ids: Tensor | None = None, cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log p(x_t | x_<t) under ``softmax(logits / temperature)``, truncated like the
    sampler when ``top_k > 0`` or ``top_p < 1`` (see "Truncation" above).

    Args:
        model: an HF causal LM (``model(input_ids, attention_mask, position_ids).logits``).
        input_ids: ``[B, T]`` token ids; padding may hold any id. Packed: ``[1, N]``.
        attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding (right or left); None for a
            packed row, which then needs ``position_ids`` ``[1, N]`` (restarting at 0 with every
            sequence) and ``cu_seqlens`` ``[S + 1]`` (see "Layouts").
        temperature: the sampling temperature; 0 (greedy) is treated as 1.
        return_entropy: also return the entropy of the next-token distribution.
        top_k, top_p: the sampler's truncation (0 and 1 = none).

    Returns:
        ``logprobs [B, T]`` float32, and with ``return_entropy`` also ``entropy [B, T]`` float32 where
        ``entropy[:, t]`` is the entropy of the distribution x_t was drawn from. Both hold 0 at
        t = 0, at padding, and wherever token t-1 is padding (packed: at each sequence's first
        token). Gradients flow to the model.
    """
    kwargs, keep = model_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
    require_shared_prefix_support(model, kwargs)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    temperature = 1.0 if temperature == 0 else float(temperature)
    targets = input_ids[:, 1:].long()
    parts = decoder_and_head(model)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if parts is not None and targets.numel() * vocab * 4 > CHUNK_ABOVE_BYTES:
        decoder, head = parts
        hidden = decoder(**kwargs).last_hidden_state[:, :-1]
        picked, entropy = chunked_logprobs(hidden, targets, head, vocab, temperature, top_k, top_p,
                                           return_entropy)
    else:
        logits = model(**kwargs).logits[:, :-1]  # [B, T-1, V]: logits[:, t-1] predicts x_t
        picked, entropy = scored_logprobs(logits, targets, temperature, top_k, top_p, return_entropy)
    zero = picked.new_zeros(())
    first = picked.new_zeros(input_ids.shape[0], 1)
    # where, not multiply: a fully masked (left-padding) row may hold non-finite values.
    logprobs = torch.where(keep, torch.cat([first, picked], dim=1), zero)
    if not return_entropy:
        return logprobs
    return logprobs, torch.where(keep, torch.cat([first, entropy], dim=1), zero)


LOGITS_CHUNK_BYTES = 64 * 2**20
"""The float32 logits one chunk of positions may hold."""
CHUNK_ABOVE_BYTES = 256 * 2**20
"""Inputs whose whole float32 logits would pass this are scored in chunks. Below it the plain path
is kept: chunking recomputes the projection in the backward (on SmolLM2-135M, 21% of a forward's
FLOPs) for a saving that is small next to the decoder's own activations (docs/performance.md)."""


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The decoder (hidden states) and output projection of a plain causal LM, or None when its
    logits are more than ``head(decoder(x))`` or it does not say what its parts are."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        return None
    if getattr(config, "logit_scale", None) not in (None, 1.0):
        return None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if decoder is None or not isinstance(head, nn.Linear) or decoder is model:
        return None
    return decoder, head


def scored_logprobs(logits: Tensor, targets: Tensor, temperature: float, top_k: int, top_p: float,
                    want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``targets``' log-probabilities under ``logits`` ``[..., V]`` (tempered, truncated like the
    sampler) and, with ``want_entropy``, each row's entropy; both float32 ``[...]``."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    kept = None
    if top_k > 0 or top_p < 1.0:
        kept = truncation_mask(logits, top_k, top_p)
        logits = logits.masked_fill(~kept, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if kept is not None:
        picked = torch.clamp(picked, min=LOGPROB_FLOOR)
    if not want_entropy:
        return picked, None
    probs = torch.softmax(logits, dim=-1)
    if kept is None:
        plogp = probs * logits
    else:  # -inf off the kept set would send 0 * inf = NaN into the gradient, even under where
        plogp = torch.where(kept, probs * logits.masked_fill(~kept, 0.0), logits.new_zeros(()))
    return picked, lse - plogp.sum(-1)


def chunked_logprobs(hidden: Tensor, targets: Tensor, head: nn.Linear, vocab: int, temperature: float,
                     top_k: int, top_p: float, want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`scored_logprobs` of ``head(hidden)`` ``[B, T, H]``, a chunk of positions at a time, each chunk's
    logits recomputed in the backward rather than kept (see "Memory")."""
    from torch.utils.checkpoint import checkpoint

    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    n = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))

    def score(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        picked, entropy = scored_logprobs(head(h), t, temperature, top_k, top_p, want_entropy)
        return picked, entropy if entropy is not None else picked.new_zeros(())

    parts = [checkpoint(score, flat_h[i:i + n], flat_t[i:i + n], use_reentrant=False)
             for i in range(0, flat_t.numel(), n)]
    picked = torch.cat([p for p, _ in parts]).reshape(shape)
    entropy = torch.cat([e for _, e in parts]).reshape(shape) if want_entropy else None
    return picked, entropy
