"""Pure torch math for saorl: GAE variants, policy / value losses, advantage baselines, presets.

Nothing here does I/O, reads a config object or talks to another process; see ``docs/method.md``
for the method and each module's docstring for where it departs from the paper.

Importing the package imports none of its modules: the names below are loaded on first use
(PEP 562), so reading the presets (:mod:`saorl.algo.presets`, pydantic models) costs no torch import —
which is what keeps ``saorl config`` and every command's start-up fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("RunningMeanBaseline", "broadcast_to_tokens", "grpo_advantages"), "advantages"),
    **dict.fromkeys(("credit_rewards", "length_adaptive_lambda", "mc_returns", "skip_observation_gae",
                     "token_gae", "value_targets"), "gae"),
    **dict.fromkeys(("dis_policy_loss", "entropy_from_logits", "lm_loss", "masked_mean", "ppo_clip_loss",
                     "ratio_histogram", "ratio_histogram_edges", "value_loss"), "losses"),
    **dict.fromkeys(("PRESETS", "AdaptiveLambda", "AlgoPreset", "get_preset", "list_presets"), "presets"),
    **dict.fromkeys(("ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "AdvantageInputs", "get_advantage_estimator",
                     "get_policy_loss"), "registry"),
}

__all__ = sorted(_EXPORTS)  # each loaded by __getattr__ on first use


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'saorl.algo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"saorl.algo.{module}"), name)
