"""Pure torch math for saorl: GAE variants, policy / value losses, advantage baselines, presets.

Nothing here does I/O, reads a config object or talks to another process; see ``docs/method.md``
for the method and each module's docstring for where it departs from the paper.
"""

from saorl.algo.advantages import RunningMeanBaseline, broadcast_to_tokens, grpo_advantages
from saorl.algo.gae import (
    credit_rewards,
    length_adaptive_lambda,
    mc_returns,
    skip_observation_gae,
    token_gae,
    value_targets,
)
from saorl.algo.losses import (
    dis_policy_loss,
    entropy_from_logits,
    lm_loss,
    masked_mean,
    ppo_clip_loss,
    ratio_histogram,
    ratio_histogram_edges,
    value_loss,
)
from saorl.algo.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    AdvantageInputs,
    AlgoPreset,
    get_advantage_estimator,
    get_policy_loss,
    get_preset,
    list_presets,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "AdvantageInputs",
    "AlgoPreset",
    "RunningMeanBaseline",
    "broadcast_to_tokens",
    "credit_rewards",
    "dis_policy_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_preset",
    "grpo_advantages",
    "length_adaptive_lambda",
    "list_presets",
    "lm_loss",
    "masked_mean",
    "mc_returns",
    "ppo_clip_loss",
    "ratio_histogram",
    "ratio_histogram_edges",
    "skip_observation_gae",
    "token_gae",
    "value_loss",
    "value_targets",
]
