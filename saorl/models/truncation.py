"""The distribution a token is sampled from: ``softmax(logits / T)`` restricted to the ``k`` most
likely tokens, then to the smallest prefix of those (by descending probability) whose mass reaches
``top_p``, then renormalised.

One definition for both sides of the DIS ratio: the local engine samples from it
(:mod:`saorl.engines.sampling`) and the trainer scores tokens under it
(:func:`saorl.models.logprobs.token_logprobs`), so ``exp(logprob)`` is the probability the engine
really used. It lives here, below both, so that the models never import the engines.
"""

from __future__ import annotations

import torch


def filtered_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from.

    logits: [B, V] float. temperature: [B] (> 0 for every row passed here). top_k: [B] long,
    0 = off. top_p: [B] in (0, 1]. Returns [B, V] float32; tokens removed by top-k / top-p hold
    ``-inf``. Ties at the top-k boundary are broken by sort order (exactly ``k`` tokens kept).
    """
    x = logits.float() / temperature.float().unsqueeze(-1)
    if not bool((top_k > 0).any()) and bool((top_p >= 1).all()):
        return torch.log_softmax(x, dim=-1)  # nothing filtered: skip the sort
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k.unsqueeze(-1)
    sorted_x = sorted_x.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # keep a token while the mass strictly before it is below top_p (the first is always kept)
    remove = remove | (mass_before >= top_p.float().unsqueeze(-1))
    sorted_x = sorted_x.masked_fill(remove, float("-inf"))
    out = torch.full_like(x, float("-inf"))
    out.scatter_(-1, order, torch.log_softmax(sorted_x, dim=-1))
    return out
