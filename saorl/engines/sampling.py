"""Batched next-token sampling with per-row parameters, and the logprobs DIS needs.

Each row of a batch may carry its own temperature, top-k and top-p. The distribution a token
is sampled from is: ``softmax(logits / T)`` restricted to the ``k`` most likely tokens, then to
the smallest prefix of those (by descending probability) whose mass reaches ``top_p``, then
renormalised. The returned logprob is log p(token) under *that* renormalised distribution, so
``exp(logprob)`` is the probability the engine really used. Greedy rows (``T == 0``) take the
argmax and report the untempered ``log_softmax`` — the distribution a T → 0 limit would not give
a finite logprob for, so this is the convention (also vLLM's).

Sampling is inverse-CDF with one uniform draw per row from that row's own ``torch.Generator``,
so a seeded request produces the same tokens whatever else shares its batch.

The distribution itself is :func:`saorl.models.truncation.filtered_logprobs`, the one definition
the engine samples from and the trainer scores with (:mod:`saorl.models.logprobs`).
"""

from __future__ import annotations

import torch

from saorl.models.truncation import filtered_logprobs


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns ``(tokens [B] long, logprobs [B] float32)``.

    Rows with ``temperature == 0`` are greedy (``generators[i]`` unused, may be None); the
    others draw ``u ~ U[0, 1)`` from ``generators[i]`` and take the first token whose
    cumulative probability exceeds ``u``.
    """
    greedy = temperature <= 0
    tokens = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if bool(greedy.all()):
        return tokens, logprobs
    rows = (~greedy).nonzero().squeeze(-1)
    lp = filtered_logprobs(logits[rows], temperature[rows], top_k[rows], top_p[rows])
    u = torch.stack([torch.rand((), generator=generators[int(r)]) for r in rows.tolist()])
    cdf = torch.cumsum(lp.exp(), dim=-1)
    u = u.to(cdf.device) * cdf[:, -1]
    picked = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).clamp(max=lp.shape[-1] - 1)
    # never land on a zero-probability token (float round-off at the top of the CDF)
    picked_lp = lp.gather(-1, picked)
    bad = torch.isinf(picked_lp).squeeze(-1)
    if bool(bad.any()):
        picked[bad] = torch.argmax(lp[bad], dim=-1, keepdim=True)
        picked_lp = lp.gather(-1, picked)
    tokens = tokens.clone()
    logprobs = logprobs.clone()
    tokens[rows] = picked.squeeze(-1)
    logprobs[rows] = picked_lp.squeeze(-1)
    return tokens, logprobs


def top_alternatives(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row's sampling distribution and their log-probs.

    The distribution is the one :func:`sample_rows` draws from (greedy rows: the untempered
    ``log_softmax``), so ``exp`` of a value is the probability the engine used. Returns
    ``(ids [B, k] long, logprobs [B, k] float32)``, most likely first; a token the truncation
    removed holds ``-inf``.
    """
    greedy = temperature <= 0
    lp = torch.log_softmax(logits.float(), dim=-1)
    rows = (~greedy).nonzero().squeeze(-1)
    if rows.numel():
        lp[rows] = filtered_logprobs(logits[rows], temperature[rows], top_k[rows], top_p[rows])
    values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return ids, values
