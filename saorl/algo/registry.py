"""The registries the trainer dispatches through: advantage estimators and policy losses, by name.

A preset (:mod:`saorl.algo.presets`, re-exported here) names an estimator of
``ADVANTAGE_ESTIMATORS`` and a loss of ``POLICY_LOSSES``; the learner looks both up by those strings
and never branches on the algorithm's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from saorl.algo.advantages import RunningMeanBaseline, broadcast_to_tokens, grpo_advantages
from saorl.algo.gae import check_bt, length_adaptive_lambda, skip_observation_gae, token_gae
from saorl.algo.losses import dis_policy_loss, ppo_clip_loss
from saorl.algo.presets import (
    PRESETS,
    AdaptiveLambda,
    AdvantageKind,
    AlgoPreset,
    Behaviour,
    Mode,
    PolicyLossKind,
    get_preset,
    list_presets,
    setting_docs,
    setting_types,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "RUNNING_BASELINE_ESTIMATORS",
    "AdaptiveLambda",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageKind",
    "AlgoPreset",
    "Behaviour",
    "Mode",
    "PolicyLoss",
    "PolicyLossKind",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_preset",
    "keeps_running_baseline",
    "list_presets",
    "setting_docs",
    "setting_types",
]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- advantage estimators
@dataclass
class AdvantageInputs:
    """Everything any advantage estimator may read, for one batch of B trajectories.

    Shapes: ``rewards``, ``action_mask``, ``values``, ``response_mask`` are ``[B, T]``;
    ``group_ids`` is ``[B]``. ``values`` at non-chain positions are never read.
    """

    rewards: Tensor
    action_mask: Tensor
    gamma: float = 1.0
    lam: float | Tensor | AdaptiveLambda = 1.0
    """GAE λ: a float, a ``[B]`` tensor, or the length-adaptive rule (a preset's ``lam_policy``)."""
    values: Tensor | None = None
    """Critic values; required by ``gae``."""
    response_mask: Tensor | None = None
    """Action + observation tokens; required by ``gae`` with ``skip_observation = False``."""
    skip_observation: bool = True
    group_ids: Tensor | None = None
    """Prompt-group id per trajectory; required by ``grpo``."""
    grpo_eps: float = 1e-6
    grpo_normalize_std: bool = True
    baseline: RunningMeanBaseline | None = field(default=None, repr=False)
    """Running baseline, updated in place by ``running_mean``."""

    def scores(self) -> Tensor:
        """``[B]`` undiscounted total reward per trajectory (the critic-free estimators' score)."""
        check_bt(rewards=self.rewards, action_mask=self.action_mask)
        return self.rewards.sum(dim=1)


AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]
"""``(inputs) -> (advantages [B, T], returns [B, T] or None)``; both 0 off the chain / off action tokens."""


def _require(value: object, what: str, estimator: str) -> None:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{what}")


def _gae_estimator(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    _require(x.values, "values", "gae")
    chain = x.action_mask if x.skip_observation else x.response_mask
    _require(chain, "response_mask (skip_observation=False)", "gae")
    assert chain is not None and x.values is not None
    # VAPO's l counts the model's own tokens: observation tokens are not "length" the policy wrote
    lam = length_adaptive_lambda(x.action_mask, x.lam.alpha) if isinstance(x.lam, AdaptiveLambda) else x.lam
    fn = skip_observation_gae if x.skip_observation else token_gae
    return fn(x.rewards, x.values, chain, x.gamma, lam)


def _grpo_estimator(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    _require(x.group_ids, "group_ids", "grpo")
    assert x.group_ids is not None
    adv = grpo_advantages(x.scores(), x.group_ids, x.action_mask, eps=x.grpo_eps,
                          normalize_std=x.grpo_normalize_std)
    return adv, None


def _running_mean_estimator(x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    _require(x.baseline, "baseline", "running_mean")
    assert x.baseline is not None
    return broadcast_to_tokens(x.baseline.update(x.scores()), x.action_mask), None


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": _gae_estimator,
    "grpo": _grpo_estimator,
    "running_mean": _running_mean_estimator,
}

RUNNING_BASELINE_ESTIMATORS: frozenset[str] = frozenset({"running_mean"})
"""The estimators that update ``AdvantageInputs.baseline`` in place: a learner whose share of a
step is empty still updates it (an all-gather in a sharded trainer) and logs its value."""


def keeps_running_baseline(kind: str) -> bool:
    """Whether the advantage estimator ``kind`` keeps a running baseline
    (:data:`RUNNING_BASELINE_ESTIMATORS`)."""
    get_advantage_estimator(kind)  # an unknown name is an error, not False
    return kind in RUNNING_BASELINE_ESTIMATORS

PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, float, float], tuple[Tensor, dict[str, float]]]
"""``(logprobs, behaviour_logprobs, advantages, action_mask, eps_low, eps_high) -> (loss, metrics)``."""

POLICY_LOSSES: dict[str, PolicyLoss] = {"dis": dis_policy_loss, "ppo": ppo_clip_loss}


def get_advantage_estimator(kind: str) -> AdvantageEstimator:
    if kind not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {kind!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[kind]


def get_policy_loss(kind: str) -> PolicyLoss:
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[kind]
