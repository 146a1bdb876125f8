"""Policy, value and auxiliary losses: tensors in, a scalar loss and a dict of float metrics out.

Policy losses share one signature
``(logprobs, behaviour_logprobs, advantages, action_mask, eps_low, eps_high) -> (loss, metrics)``:

- ``dis_policy_loss`` — SAO's direct double-sided importance sampling (docs/method.md). The ratio is
  taken against the *rollout* log-probs recorded by the engine (no π_old); tokens whose ratio
  leaves ``[1 − ε_low, 1 + ε_high]`` are masked out entirely (zero gradient), not clipped, but
  still count in the denominator.
- ``ppo_clip_loss`` — PPO's clipped surrogate with decoupled bounds (clip-higher, as in DAPO /
  VAPO), against whatever behaviour log-probs the caller passes (π_old or the rollout policy).

Every loss is a token mean over the whole batch: Σ over action tokens / number of action tokens
(a zero denominator is treated as 1, so an empty batch gives loss 0 with a valid graph). Tokens
where ``action_mask`` is 0 get exactly zero gradient even when their inputs are garbage: the log
ratio is replaced by 0 there *before* exponentiation, so no ``0 · inf`` can appear.
"""

from __future__ import annotations

import math

import torch

from saorl.algo.gae import check_bt

Tensor = torch.Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (any shape, broadcastable).

    Masked-out positions may hold anything (even NaN); an all-zero mask gives 0.
    """
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum()
    return total / m.sum().clamp(min=1)


def _denominator(mask: Tensor) -> Tensor:
    return mask.sum().clamp(min=1)


def _safe_log_ratio(logprobs: Tensor, behaviour: Tensor, keep: Tensor) -> Tensor:
    """logπ_θ − logπ_b where ``keep``, else a constant 0 (no gradient path to the garbage)."""
    return torch.where(keep, logprobs - behaviour, torch.zeros_like(logprobs))


def _ratio_stats(ratio: Tensor, mask: Tensor, prefix: str = "policy/") -> dict[str, float]:
    """Ratio mean / max / min over action tokens; an empty batch reports the on-policy value 1."""
    if not bool(mask.any()):
        return {f"{prefix}ratio_mean": 1.0, f"{prefix}ratio_max": 1.0, f"{prefix}ratio_min": 1.0}
    r = ratio[mask]
    return {
        f"{prefix}ratio_mean": r.mean().item(),
        f"{prefix}ratio_max": r.max().item(),
        f"{prefix}ratio_min": r.min().item(),
    }


def _check_band(eps_low: float, eps_high: float) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must lie in [0, 1), got {eps_low}")
    if not eps_high > 0.0:
        raise ValueError(f"eps_high must be > 0, got {eps_high}")


def dis_policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, float]]:
    """Direct double-sided importance sampling (DIS) policy loss.

        ratio_t = exp(logπ_θ(x_t) − rollout_logprobs[t])
        keep_t  = action_mask[t] · 1[1 − ε_low ≤ ratio_t ≤ 1 + ε_high]      (no gradient)
        L       = − Σ_t keep_t · ratio_t · A_t / Σ_t action_mask[t]

    Args:
        logprobs: ``[B, T]`` log π_θ(x_t) with gradient; any value where ``action_mask`` is 0.
        rollout_logprobs: ``[B, T]`` engine log-probs; any value where ``action_mask`` is 0.
        advantages: ``[B, T]`` (detached); any value where ``action_mask`` is 0.
        action_mask: ``[B, T]`` 1 at action tokens.
        eps_low, eps_high: band ``[1 − eps_low, 1 + eps_high]``; 0 ≤ eps_low < 1, eps_high > 0.
    Returns:
        ``(loss, metrics)``: scalar loss; metrics ``policy/dis_kept_frac``,
        ``policy/dis_masked_low_frac``, ``policy/dis_masked_high_frac`` (fractions of action tokens;
        they sum to 1), ``policy/ratio_mean``, ``policy/ratio_max``, ``policy/ratio_min`` (over
        action tokens, before masking; ``ratio_max`` is inf if a log-ratio overflows ``exp``).
        Tokens outside the band or the mask get exactly zero gradient.
    """
    check_bt(logprobs=logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages,
             action_mask=action_mask)
    _check_band(eps_low, eps_high)
    mask = action_mask.bool()
    with torch.no_grad():
        ratio_raw = torch.exp(_safe_log_ratio(logprobs.detach(), rollout_logprobs, mask))
        low = mask & (ratio_raw < 1.0 - eps_low)
        high = mask & (ratio_raw > 1.0 + eps_high)
        keep = mask & ~low & ~high
    ratio = torch.exp(_safe_log_ratio(logprobs, rollout_logprobs.detach(), keep))
    adv = torch.where(keep, advantages.detach(), torch.zeros_like(ratio))
    loss = -(ratio * adv).sum() / _denominator(mask)

    n = max(int(mask.sum()), 1)
    metrics = {
        "policy/dis_kept_frac": keep.sum().item() / n if mask.any() else 1.0,
        "policy/dis_masked_low_frac": low.sum().item() / n,
        "policy/dis_masked_high_frac": high.sum().item() / n,
    }
    metrics.update(_ratio_stats(ratio_raw, mask))
    return loss, metrics


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with decoupled bounds (clip-higher).

        ratio_t = exp(logπ_θ(x_t) − old_logprobs[t])
        L       = − Σ_t m_t · min(ratio_t A_t, clip(ratio_t, 1 − ε_low, 1 + ε_high) A_t) / Σ_t m_t

    Args:
        logprobs: ``[B, T]`` with gradient; any value where ``action_mask`` is 0.
        old_logprobs: ``[B, T]`` behaviour log-probs (π_old or rollout); any value off-mask.
        advantages: ``[B, T]``; any value off-mask.
        action_mask: ``[B, T]``.
        eps_low, eps_high: clip range ``[1 − eps_low, 1 + eps_high]``.
    Returns:
        ``(loss, metrics)``; metrics ``policy/clip_frac`` (fraction of action tokens where the
        clipped term is the active one, so their gradient is zero), ``policy/ratio_mean``,
        ``policy/ratio_max``, ``policy/ratio_min``.
    """
    check_bt(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, action_mask=action_mask)
    _check_band(eps_low, eps_high)
    mask = action_mask.bool()
    adv = torch.where(mask, advantages.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(_safe_log_ratio(logprobs, old_logprobs.detach(), mask))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.where(mask, torch.minimum(surr1, surr2), torch.zeros_like(surr1)).sum() / _denominator(mask)

    with torch.no_grad():
        clipped = mask & (surr2 < surr1)
        metrics = {"policy/clip_frac": clipped.sum().item() / max(int(mask.sum()), 1)}
        metrics.update(_ratio_stats(ratio.detach(), mask))
    return loss, metrics


def _explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var[R − V] / Var[R] over masked tokens; 0.0 when Var[R] is 0 (up to rounding: below
    1e-10 of the returns' mean square, where the ratio would be noise, e.g. −1e15 when every
    trajectory of a batch has the same reward) or < 2 tokens."""
    if int(mask.sum()) < 2:
        return 0.0
    r = returns[mask].double()
    resid = r - values[mask].double()
    var_r = r.var(unbiased=False)
    if float(var_r) <= 1e-10 * max(1.0, float((r * r).mean())):
        return 0.0
    return float(1.0 - resid.var(unbiased=False) / var_r)


def value_loss(
    values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    old_values: Tensor | None = None,
    clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Critic regression loss: 0.5 · (V − R)² token mean over ``action_mask``.

    With both ``old_values`` and ``clip`` given, PPO's clipped variant
    ``0.5 · max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²)``.

    Args:
        values: ``[B, T]`` critic outputs with gradient; any value off-mask.
        returns: ``[B, T]`` targets; any value off-mask.
        action_mask: ``[B, T]`` tokens that carry a value target.
        old_values: ``[B, T]`` critic outputs at rollout time (only for clipping).
        clip: clip range c > 0, or None.
    Returns:
        ``(loss, metrics)``; metrics ``critic/value_loss``, ``critic/explained_var``
        (0.0 when Var[R] is 0), ``critic/value_mean``, ``critic/return_mean``, and
        ``critic/clip_frac`` when clipping.
    """
    check_bt(values=values, returns=returns, action_mask=action_mask, old_values=old_values)
    if (old_values is None) != (clip is None):
        raise ValueError("value_loss: old_values and clip must be given together (or neither)")
    if clip is not None and not clip > 0:
        raise ValueError(f"value_loss: clip must be > 0, got {clip}")
    mask = action_mask.bool()
    zeros = torch.zeros_like(values)
    v = torch.where(mask, values, zeros)
    r = torch.where(mask, returns.detach().to(values.dtype), zeros)
    sq = (v - r) ** 2
    metrics: dict[str, float] = {}
    if old_values is not None and clip is not None:
        v_old = torch.where(mask, old_values.detach().to(values.dtype), zeros)
        v_clip = v_old + (v - v_old).clamp(-clip, clip)
        sq_clip = (v_clip - r) ** 2
        metrics["critic/clip_frac"] = masked_mean((sq_clip > sq).float(), mask).item()
        sq = torch.maximum(sq, sq_clip)
    loss = 0.5 * sq.sum() / _denominator(mask)
    with torch.no_grad():
        metrics["critic/value_loss"] = loss.item()
        metrics["critic/explained_var"] = _explained_variance(v.detach(), r, mask)
        metrics["critic/value_mean"] = masked_mean(v.detach(), mask).item()
        metrics["critic/return_mean"] = masked_mean(r, mask).item()
    return loss, metrics


def lm_loss(logprobs: Tensor, action_mask: Tensor, weights: Tensor) -> Tensor:
    """Positive-example LM (NLL) loss, as in VAPO: − Σ w_b m_bt logπ(x_bt) / Σ w_b m_bt.

    Args:
        logprobs: ``[B, T]`` log π_θ(x_t) with gradient; any value where ``action_mask`` is 0.
        action_mask: ``[B, T]``.
        weights: ``[B]`` non-negative per-trajectory weights (1 for positive trajectories, 0 for
            the rest), so with 0/1 weights this is a token mean over positive trajectories.
    Returns:
        scalar loss; 0 (with a valid graph) when no token has positive weight.
    """
    batch, _ = check_bt(logprobs=logprobs, action_mask=action_mask)
    if weights.shape != (batch,):
        raise ValueError(f"weights must have shape [B]=[{batch}], got {tuple(weights.shape)}")
    if bool((weights < 0).any()):
        raise ValueError("weights must be non-negative")
    w = weights.detach().to(logprobs.dtype)[:, None] * action_mask.to(logprobs.dtype)
    nll = torch.where(w > 0, -logprobs, torch.zeros_like(logprobs))
    denom = w.sum()
    return (w * nll).sum() / torch.where(denom > 0, denom, torch.ones_like(denom))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution at each position.

    Args:
        logits: ``[B, T, V]`` finite logits.
    Returns:
        ``[B, T]`` entropy in nats: logsumexp(z) − Σ softmax(z)·z (differentiable).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def ratio_histogram_edges(bins: int = 24, lo: float = 1e-2, hi: float = 1e2) -> Tensor:
    """The ``bins + 1`` bin edges of :func:`ratio_histogram`: ``logspace(log10 lo, log10 hi)``, float64."""
    if bins < 1 or not 0 < lo < hi:
        raise ValueError(f"need bins >= 1 and 0 < lo < hi, got bins={bins}, lo={lo}, hi={hi}")
    return torch.logspace(math.log10(lo), math.log10(hi), bins + 1, dtype=torch.float64)


def ratio_histogram(ratio: Tensor, mask: Tensor, bins: int = 24, lo: float = 1e-2,
                    hi: float = 1e2) -> tuple[Tensor, Tensor]:
    """Counts of importance ratios over fixed log-spaced edges (for the per-step ratio plot).

    Args:
        ratio: any shape; only entries where ``mask`` is 1 are counted.
        mask: same shape as ``ratio``.
        bins: number of bins; edges are ``logspace(log10 lo, log10 hi, bins + 1)``.
        lo, hi: range; ratios below ``lo`` fall in the first bin, above ``hi`` in the last
            (NaN ratios are not counted).
    Returns:
        ``(counts [bins] int64, edges [bins + 1] float64)``; counts sum to the number of
        finite-or-infinite masked ratios.
    """
    if ratio.shape != mask.shape:
        raise ValueError(f"ratio shape {tuple(ratio.shape)} != mask shape {tuple(mask.shape)}")
    edges = ratio_histogram_edges(bins, lo, hi)
    r = ratio.detach()[mask.bool()].double().cpu()
    r = r[~torch.isnan(r)]
    idx = torch.bucketize(r, edges[1:-1], right=True)  # bin i holds edges[i] <= r < edges[i+1]
    counts = torch.bincount(idx, minlength=bins)
    return counts, edges
