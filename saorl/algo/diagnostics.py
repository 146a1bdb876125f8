"""How far the rollout policy is from the trainer's: the mismatch that DIS exists to absorb.

For the action tokens of a batch, with ``r_t = π_θ(x_t) / π_rollout(x_t)`` (the trainer's current
policy over the engine's recorded one):

- ``KL(rollout ‖ trainer)``, estimated from the sampled tokens with the non-negative, unbiased
  ``k3`` estimator ``E[(r − 1) − log r]`` (the samples come from the rollout policy);
- the fraction of tokens outside the DIS band ``[1 − ε_low, 1 + ε_high]`` (what DIS masks);
- given the advantages, the share of the uncorrected importance-weighted gradient that falls on
  those tokens: the gradient of ``−Σ_t r_t A_t`` is ``−Σ_t r_t A_t ∇log π_θ(x_t)``, and the
  share is ``Σ_outside |r_t A_t| / Σ_t |r_t A_t|``, each token's weight on its own score function
  (the per-token gradient norms themselves would cost a backward pass per token).

The KL and the fraction are reported overall and per staleness bucket (versions between the
token's sampler and the trainer), the weight share overall only. Staleness 0 isolates the
engine/trainer mismatch itself (same weights, different numerics or routing); larger staleness
adds the policy's own drift.
"""

from __future__ import annotations

import math

import torch

from saorl.algo.gae import check_bt

Tensor = torch.Tensor

STALENESS_BUCKETS: tuple[tuple[int, int], ...] = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 1 << 30))
"""Inclusive staleness ranges, each reported as ``s<lo>`` / ``s<lo>_<hi>`` / ``s<lo>+``."""


def _bucket_name(lo: int, hi: int) -> str:
    if lo == hi:
        return f"s{lo}"
    return f"s{lo}+" if hi >= 1 << 30 else f"s{lo}_{hi}"


@torch.no_grad()
def mismatch_metrics(logprobs: Tensor, rollout_logprobs: Tensor, action_mask: Tensor, staleness: Tensor,
                     eps_low: float, eps_high: float, prefix: str = "mismatch/",
                     advantages: Tensor | None = None) -> dict[str, float]:
    """KL(rollout ‖ trainer) and the out-of-band fraction, overall and per staleness bucket.

    Args:
        logprobs: ``[B, T]`` the trainer's log-probs of the sampled tokens; any value off-mask.
        rollout_logprobs: ``[B, T]`` the engine's; any value off-mask.
        action_mask: ``[B, T]``.
        staleness: ``[B, T]`` integer versions between each token's sampler and the trainer.
        eps_low, eps_high: the DIS band.
        advantages: optional ``[B, T]``; with them, ``{prefix}outside_band_weight_share`` is
            reported too (left out when every weight ``|r_t A_t|`` is 0).
    Returns:
        ``{prefix}kl``, ``{prefix}outside_band_frac`` (with ``advantages``, also
        ``{prefix}outside_band_weight_share``) and, for every bucket with action tokens,
        ``{prefix}kl_<bucket>``, ``{prefix}outside_band_frac_<bucket>``, ``{prefix}tokens_<bucket>``.
        Empty buckets are left out (an empty batch gives ``{}``).
    """
    check_bt(logprobs=logprobs, rollout_logprobs=rollout_logprobs, action_mask=action_mask,
             staleness=staleness)
    mask = action_mask.bool()
    log_r = torch.where(mask, logprobs.double() - rollout_logprobs.double(), 0.0)
    k3 = torch.expm1(log_r) - log_r
    ratio = torch.exp(log_r)
    outside = mask & ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high))

    def stats(sel: Tensor, suffix: str) -> dict[str, float]:
        n = int(sel.sum())
        if n == 0:
            return {}
        return {f"{prefix}kl{suffix}": float(k3[sel].mean()),
                f"{prefix}outside_band_frac{suffix}": float(outside[sel].sum()) / n}

    out = stats(mask, "")
    if advantages is not None and out:
        check_bt(logprobs=logprobs, advantages=advantages)
        weight = torch.where(mask, (ratio * advantages.double()).abs(), 0.0)
        total = float(weight.sum())
        if total > 0.0 and math.isfinite(total):
            out[f"{prefix}outside_band_weight_share"] = float(weight[outside].sum()) / total
    for lo, hi in STALENESS_BUCKETS:
        sel = mask & (staleness >= lo) & (staleness <= hi)
        bucket = stats(sel, f"_{_bucket_name(lo, hi)}")
        if bucket:
            bucket[f"{prefix}tokens_{_bucket_name(lo, hi)}"] = float(sel.sum())
        out |= bucket
    return out


@torch.no_grad()
def first_action_advantages(advantages: Tensor, rewards: Tensor,
                            action_mask: Tensor) -> tuple[Tensor, Tensor]:
    """For each row with an action token: the advantage at its first action token and its
    undiscounted return (the sum of its rewards), both float64 on the CPU, in row order."""
    check_bt(advantages=advantages, rewards=rewards, action_mask=action_mask)
    mask = action_mask.bool()
    rows = mask.any(dim=1)
    first = mask.double().argmax(dim=1)  # index of the first action token (argmax of the first 1)
    first_adv = advantages.detach().double().gather(1, first[:, None])[:, 0][rows]
    return first_adv.cpu(), rewards.detach().double().sum(dim=1)[rows].cpu()


@torch.no_grad()
def advantage_spread(advantages: Tensor, rewards: Tensor, action_mask: Tensor,
                     prefix: str = "adv/") -> dict[str, float]:
    """How much credit reaches a trajectory's first decision, against how much there is to give.

    ``first_token_std``: the standard deviation over the batch of the advantage at each
    trajectory's first action token — the signal that moves its first decision. ``return_std``: the
    standard deviation over the batch of the undiscounted returns (the sum of each row's rewards),
    the spread a Monte-Carlo advantage (λ = 1, group or running-mean baseline) would give it. With
    λ < 1 and a weak critic, GAE shrinks the first by λ^(tokens to the reward). Both are population
    standard deviations (divided by n) over the rows that have an action token; fewer than two
    such rows give 0.

    Args:
        advantages: ``[B, T]`` per-token advantages; any value off-mask.
        rewards: ``[B, T]`` per-token rewards (zero where none).
        action_mask: ``[B, T]``.
    Returns:
        ``{prefix}first_token_std`` and ``{prefix}return_std``; ``{}`` if no row has an action token.
    """
    first_adv, returns = first_action_advantages(advantages, rewards, action_mask)
    if not len(first_adv):
        return {}
    return {f"{prefix}first_token_std": float(first_adv.std(unbiased=False)) if len(first_adv) > 1 else 0.0,
            f"{prefix}return_std": float(returns.std(unbiased=False)) if len(returns) > 1 else 0.0}
