"""Generalised advantage estimation along the *action chain* of agent trajectories.

All functions take right- or left-padded batches of shape ``[B, T]`` (B trajectories, T token
positions) and are batched over B; the only Python loop is a reverse scan over T.

Skip-observation GAE (docs/method.md). For one row let ``a_1 < … < a_n`` be the positions where
``action_mask`` is 1. The recursion skips every other position (prompt, observation, padding):

    δ_k = r_{a_k} + γ · V(a_{k+1}) − V(a_k)          V(a_{n+1}) = 0
    A_k = Σ_{j ≥ k} (γλ)^{j−k} δ_j                    R_k = A_k + V(a_k)

so γ discounts per *action token*, not per position, and an observation segment between two
turns costs no discount and contributes no value estimate.

Reward crediting. A reward on a non-action position ``t`` is credited to the last action position
``≤ t`` (e.g. the environment's reward written on an observation token goes to the final token
of the turn that caused it). the method leaves rewards *before the first action* open; here they
are credited to the **first** action position, so that ``Σ_t r_t`` is preserved for every row with
at least one action token (nothing is dropped silently). A row with no action token has no chain:
its rewards are dropped and its advantages / returns are all zero.

Values at non-action positions are never read (they may hold anything, even NaN), which is what
makes the critic's outputs on observation tokens irrelevant to the policy update.

``token_gae`` is the ablation: the same recursion over every position where ``response_mask`` is 1,
i.e. the chain runs through observation tokens too. With no observation tokens the two coincide.

Everything here runs under ``torch.no_grad``: outputs are detached targets.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def check_bt(**tensors: Tensor | None) -> tuple[int, int]:
    """Check that every given tensor is 2-D with one shared shape ``[B, T]``; return ``(B, T)``.

    ``None`` entries are skipped. Raises ``ValueError`` naming the offending argument.
    """
    shape: tuple[int, int] | None = None
    first = ""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got {tuple(x.shape)}")
        if shape is None:
            shape, first = (x.shape[0], x.shape[1]), name
        elif tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {first} has shape {shape}")
    if shape is None:
        raise ValueError("no tensor given")
    return shape


def _float_dtype(*xs: Tensor) -> torch.dtype:
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype if dtype.is_floating_point else torch.float32


def _lambda_per_row(lam: float | Tensor, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """λ as a ``[B]`` tensor; a float is broadcast. Values must lie in [0, 1]."""
    if isinstance(lam, torch.Tensor):
        if lam.dim() == 0:
            lam = lam.reshape(1).expand(batch)
        if lam.shape != (batch,):
            raise ValueError(f"lam tensor must have shape [B]=[{batch}], got {tuple(lam.shape)}")
        lam_t = lam.detach().to(dtype=dtype, device=device)
    else:
        lam_t = torch.full((batch,), float(lam), dtype=dtype, device=device)
    if not bool(((lam_t >= 0) & (lam_t <= 1)).all()):
        raise ValueError(f"lam must lie in [0, 1], got {lam_t.min().item()}..{lam_t.max().item()}")
    return lam_t


def _check_gamma(gamma: float) -> float:
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    return gamma


def credit_rewards(rewards: Tensor, action_mask: Tensor) -> Tensor:
    """Move every reward onto an action position (see the module docstring for the rule).

    Args:
        rewards: ``[B, T]`` per-token rewards, any position.
        action_mask: ``[B, T]`` 1 / True at action tokens.
    Returns:
        ``[B, T]`` credited rewards; zero wherever ``action_mask`` is 0. Row sums are preserved for
        rows that have at least one action token; rows without one are all zero.
    """
    batch, length = check_bt(rewards=rewards, action_mask=action_mask)
    mask = action_mask.bool()
    pos = torch.arange(length, device=mask.device).expand(batch, length)
    last = torch.where(mask, pos, -1).cummax(dim=1).values  # last action position <= t, or -1
    first = torch.where(mask, pos, length).min(dim=1, keepdim=True).values
    target = torch.where(last >= 0, last, first)
    target = torch.where(mask.any(dim=1, keepdim=True), target, 0)
    credited = torch.zeros_like(rewards).scatter_add_(1, target, rewards)
    return torch.where(mask, credited, torch.zeros_like(credited))


def _next_chain_values(values: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]``: at each position t, V at the next chain position strictly after t (0 if none)."""
    batch, length = mask.shape
    pos = torch.arange(length, device=mask.device).expand(batch, length)
    next_ge = torch.where(mask, pos, length).flip(1).cummin(dim=1).values.flip(1)
    next_gt = torch.cat([next_ge[:, 1:], next_ge.new_full((batch, 1), length)], dim=1)
    padded = torch.cat([torch.where(mask, values, 0.0), values.new_zeros(batch, 1)], dim=1)
    return padded.gather(1, next_gt)


@torch.no_grad()
def skip_observation_gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Token-level GAE whose chain visits only action tokens (docs/method.md).

    Args:
        rewards: ``[B, T]`` per-token rewards; rewards on non-action positions are credited to
            an action position first (``credit_rewards``).
        values: ``[B, T]`` V(s_t); read only where ``action_mask`` is 1 (others may be anything).
        action_mask: ``[B, T]`` 1 / True at action tokens.
        gamma: discount per action token, in [0, 1].
        lam: λ in [0, 1], a float or a ``[B]`` tensor (per-trajectory λ, e.g. VAPO's
            ``length_adaptive_lambda``).
    Returns:
        ``(advantages, returns)``, both ``[B, T]`` detached, in the promoted floating dtype of
        ``rewards``/``values``; exactly 0 wherever ``action_mask`` is 0.
    """
    batch, length = check_bt(rewards=rewards, values=values, action_mask=action_mask)
    gamma = _check_gamma(gamma)
    dtype = _float_dtype(rewards, values)
    rewards, values = rewards.to(dtype), values.to(dtype)
    mask = action_mask.bool()
    coef = gamma * _lambda_per_row(lam, batch, dtype, values.device)

    r = credit_rewards(rewards, mask)
    v = torch.where(mask, values, 0.0)
    delta = torch.where(mask, r + gamma * _next_chain_values(values, mask) - v, 0.0)

    adv = torch.zeros_like(delta)
    carry = delta.new_zeros(batch)  # A at the nearest chain position to the right
    for t in range(length - 1, -1, -1):
        a_t = delta[:, t] + coef * carry
        m_t = mask[:, t]
        carry = torch.where(m_t, a_t, carry)
        adv[:, t] = torch.where(m_t, a_t, 0.0)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


def token_gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Plain token-level GAE (the ablation): the chain runs through every response position.

    Identical recursion to ``skip_observation_gae`` with ``response_mask`` (actions *and*
    observation tokens) as the chain, so observation tokens are discounted, carry a value
    estimate and receive advantages / returns of their own. The policy loss still applies only
    on action tokens (it multiplies by ``action_mask``).

    Args:
        rewards, values: ``[B, T]``; ``values`` read only where ``response_mask`` is 1.
        response_mask: ``[B, T]`` 1 on every response token (action or observation); 0 on
            prompt and padding.
        gamma, lam: as in ``skip_observation_gae``.
    Returns:
        ``(advantages, returns)`` ``[B, T]``, zero wherever ``response_mask`` is 0.
    """
    return skip_observation_gae(rewards, values, response_mask, gamma, lam)


def length_adaptive_lambda(action_mask: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive λ_policy = 1 − 1/(α·l), l = number of action tokens in the row.

    Args:
        action_mask: ``[B, T]``.
        alpha: α > 0 (VAPO uses 0.05).
    Returns:
        ``[B]`` float tensor clamped to [0, 1]. Rows with l = 0 get 0 (the limit as α·l → 0⁺;
        such rows have no chain, so the value is never used).
    """
    check_bt(action_mask=action_mask)
    alpha = float(alpha)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    length = action_mask.bool().sum(dim=1).to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1.0))
    lam = torch.where(length > 0, lam, torch.zeros_like(lam))
    return lam.clamp(0.0, 1.0)


def mc_returns(rewards: Tensor, action_mask: Tensor, gamma: float) -> Tensor:
    """Monte-Carlo returns along the action chain: R_k = Σ_{j ≥ k} γ^{j−k} r_{a_j}.

    This is GAE with λ = 1, which does not depend on V; used as critic targets
    (λ_critic = 1) and for value pretraining.

    Args:
        rewards: ``[B, T]`` (credited to action positions as in ``skip_observation_gae``).
        action_mask: ``[B, T]``.
        gamma: discount per action token.
    Returns:
        ``[B, T]`` detached returns, zero wherever ``action_mask`` is 0.
    """
    check_bt(rewards=rewards, action_mask=action_mask)
    zeros = torch.zeros_like(rewards, dtype=_float_dtype(rewards))
    _, returns = skip_observation_gae(rewards, zeros, action_mask, gamma, 1.0)
    return returns


def value_targets(rewards: Tensor, values: Tensor | None, action_mask: Tensor, response_mask: Tensor, *,
                  gamma: float, lam: float, skip_observation: bool) -> tuple[Tensor, Tensor]:
    """The critic's regression targets: λ-returns along the chain, and the chain itself.

    The chain is ``action_mask`` with ``skip_observation`` (skip-observation GAE) and
    ``response_mask`` without (token GAE through observation tokens). With ``lam = 1`` the
    returns are Monte-Carlo along the chain (``R_k = Σ_{j≥k} γ^{j−k} r_{a_j}``) and ``values`` is
    not read (it may be None); otherwise ``values`` ``[B, T]`` is required.

    Args:
        rewards, action_mask, response_mask: ``[B, T]``.
        values: ``[B, T]`` critic values (read only on the chain), or None when ``lam == 1``.
        gamma, lam: discount and λ in [0, 1].
    Returns:
        ``(returns [B, T], chain [B, T])``; returns are 0 wherever the chain mask is 0.
    """
    chain = action_mask if skip_observation else response_mask
    if lam == 1.0:
        return mc_returns(rewards, chain, gamma), chain
    if values is None:
        raise ValueError(f"value_targets with lam={lam} needs the critic's values")
    return skip_observation_gae(rewards, values, chain, gamma, lam)[1], chain
