"""Critic-free advantage baselines: GRPO's group normalisation and a running-mean baseline.

Both produce one scalar per trajectory, which ``broadcast_to_tokens`` spreads over its action
tokens (every action token of a trajectory gets the same advantage; all other positions get 0).

- ``grpo_advantages``: A_i = (s_i − mean_g) / (std_g + eps) over the group g of trajectories that
  share a prompt. ``std`` is the unbiased sample std (torch.std, as in TRL / verl). A group of
  one trajectory has advantage 0 (its own mean) — where verl instead passes the raw score through.
- ``RunningMeanBaseline``: REINFORCE with an exponential moving average of scores as baseline,
  the paper's online single-rollout baseline. The advantage of a batch is taken against the
  baseline *before* the batch is folded in, so a trajectory never baselines against itself.
"""

from __future__ import annotations

import torch

from saorl.algo.gae import check_bt

Tensor = torch.Tensor


def broadcast_to_tokens(adv: Tensor, action_mask: Tensor) -> Tensor:
    """Spread per-trajectory advantages over action tokens.

    Args:
        adv: ``[B]`` one advantage per trajectory.
        action_mask: ``[B, T]``.
    Returns:
        ``[B, T]`` float tensor: ``adv[b]`` where ``action_mask`` is 1, exactly 0 elsewhere.
    """
    batch, _ = check_bt(action_mask=action_mask)
    if adv.shape != (batch,):
        raise ValueError(f"adv must have shape [B]=[{batch}], got {tuple(adv.shape)}")
    dtype = adv.dtype if adv.dtype.is_floating_point else torch.float32
    adv = adv.to(dtype)
    return torch.where(action_mask.bool(), adv[:, None], torch.zeros((), dtype=dtype, device=adv.device))


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    action_mask: Tensor,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Tensor:
    """GRPO's group-relative advantage, broadcast over action tokens.

    Args:
        scores: ``[B]`` scalar score (total reward) per trajectory.
        group_ids: ``[B]`` integer id of the prompt group each trajectory belongs to; ids need
            not be contiguous or sorted.
        action_mask: ``[B, T]``.
        eps: added to the group std before dividing.
        normalize_std: divide by (std + eps); False gives Dr.GRPO-style mean-centring only.
    Returns:
        ``[B, T]`` advantages, (s_i − mean_g)/(std_g + eps) on action tokens, 0 elsewhere.
        Singleton groups get 0.
    """
    batch, _ = check_bt(action_mask=action_mask)
    if scores.shape != (batch,) or group_ids.shape != (batch,):
        raise ValueError(f"scores and group_ids must have shape [B]=[{batch}], got "
                         f"{tuple(scores.shape)} and {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    s = scores.to(torch.float64)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(torch.float64)
    mean = torch.zeros_like(n).index_add_(0, inverse, s) / n
    centred = s - mean[inverse]
    if normalize_std:
        sq = torch.zeros_like(n).index_add_(0, inverse, centred**2)
        std = torch.sqrt(sq / (n - 1).clamp(min=1))
        denom = std[inverse] + eps
        # denom == 0 only when eps == 0 and the group is constant, where centred is 0 too.
        centred = torch.where(denom > 0, centred / denom.clamp(min=torch.finfo(denom.dtype).tiny), 0.0)
    dtype = scores.dtype if scores.dtype.is_floating_point else torch.float32
    return broadcast_to_tokens(centred.to(dtype), action_mask)


class RunningMeanBaseline:
    """Exponential moving average of trajectory scores, used as a REINFORCE baseline.

    ``update(scores)`` returns ``scores − b`` with ``b`` the baseline *before* this batch, then sets
    ``b ← momentum · b + (1 − momentum) · mean(scores)`` (one step per batch, whatever its size).
    Before the first update there is no baseline: the first batch is baselined against its own
    mean, which then becomes ``b`` (``init`` gives a fixed starting value instead).
    """

    def __init__(self, momentum: float = 0.9, init: float | None = None) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        self.momentum = float(momentum)
        self.value: float | None = None if init is None else float(init)
        self.num_updates = 0

    @torch.no_grad()
    def update(self, scores: Tensor) -> Tensor:
        """Advantages ``[B]`` for this batch, then fold the batch into the baseline."""
        if scores.dim() != 1 or scores.numel() == 0:
            raise ValueError(f"scores must be a non-empty [B] tensor, got shape {tuple(scores.shape)}")
        s = scores.to(torch.float64)
        batch_mean = float(s.mean())
        baseline = batch_mean if self.value is None else self.value
        dtype = scores.dtype if scores.dtype.is_floating_point else torch.float32
        adv = (s - baseline).to(dtype)
        if self.value is None:
            self.value = batch_mean
        else:
            self.value = self.momentum * self.value + (1.0 - self.momentum) * batch_mean
        self.num_updates += 1
        return adv

    def state_dict(self) -> dict[str, float | int | None]:
        return {"momentum": self.momentum, "value": self.value, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        missing = {"momentum", "value", "num_updates"} - set(state)
        if missing:
            raise ValueError(f"RunningMeanBaseline state is missing {sorted(missing)}")
        momentum = float(state["momentum"])  # type: ignore[arg-type]
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        self.momentum = momentum
        self.value = None if state["value"] is None else float(state["value"])  # type: ignore[arg-type]
        self.num_updates = int(state["num_updates"])  # type: ignore[arg-type]
