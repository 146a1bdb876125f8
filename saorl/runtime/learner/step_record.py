"""What one trainer step leaves behind: its per-token values, its counters, its result and metrics.

Both learners run the same step (:meth:`saorl.runtime.learner.single.Learner.step`) over their share of
the batch and fill one :class:`StepRecord` with the per-token values it produced. The single-process
learner hands its record to :func:`step_metrics` as it is (``[B, T]`` tensors with their masks);
the sharded learner gathers every rank's record to rank 0 as rows of one token each
(:meth:`StepRecord.rows`, :meth:`StepRecord.concat`), where the masks are all ones. The metrics are
the same functions over the whole batch either way: one metrics function for both learners.

:class:`LearnerCounters` are the learner's numbers that checkpoints save and restore (the policy
version, the steps done, the non-finite skips, the running-mean baseline): one record, one
``state()`` / ``restore()``, whatever the learner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from saorl.algo.advantages import RunningMeanBaseline
from saorl.algo.diagnostics import advantage_spread, mismatch_metrics
from saorl.algo.losses import lm_loss, masked_mean, ratio_histogram, value_loss
from saorl.algo.registry import POLICY_LOSSES, AlgoPreset

Tensor = torch.Tensor


@dataclass
class LearnerCounters:
    """The learner's counters, saved in every checkpoint's manifest (under these keys)."""

    baseline: RunningMeanBaseline
    version: int = 0
    """The policy version: it advances when an update changes the policy's weights."""
    steps_done: int = 0
    """Trainer steps taken (skipped updates included)."""
    nonfinite_skips: int = 0
    """Optimizer steps skipped because a loss, a gradient or a weight would not be finite."""

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "learner_steps": self.steps_done,
                "nonfinite_skips": self.nonfinite_skips, "baseline": self.baseline.state_dict()}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.version, self.steps_done = int(state["version"]), int(state["learner_steps"])
        self.nonfinite_skips = int(state["nonfinite_skips"])
        self.baseline.load_state_dict(state["baseline"])


class StepResult(dict):
    """What :meth:`~saorl.runtime.learner.single.Learner.step` returns: the step's metrics (it is their
    dict, ``result["policy/loss"]``, written to ``metrics.jsonl`` as is), whether an update of the
    step was skipped, and the policy version after it."""

    def __init__(self, metrics: Mapping[str, Any], *, skipped: bool, version: int,
                 frozen: bool = False) -> None:
        super().__init__(metrics)
        self.skipped = skipped
        """An optimizer step of this trainer step (critic or policy) was skipped: non-finite."""
        self.version = version
        self.frozen = frozen
        """A critic warm-up step (``trainer.critic_warmup_steps``): the policy was not updated."""


@dataclass
class StepRecord:
    """One share's per-token values of a step; each column holds values where its mask is 1.

    Policy columns, on ``action_mask``: the trainer's log-probs, the rollout's, the advantages,
    the entropies, the staleness (versions between each token's sampler and the trainer before
    the update) and ``lm_weights`` (VAPO's LM-loss weights: 1 on positive trajectories' actions).
    ``first_advantages`` / ``returns``: one entry per trajectory with an action token. Critic
    columns (with a critic), on ``value_mask``: the values the first update saw, the targets, the
    values before the updates (value clipping only) and the values after them.
    """

    action_mask: Tensor
    logprobs: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    entropy: Tensor
    staleness: Tensor
    lm_weights: Tensor | None
    first_advantages: Tensor
    returns: Tensor
    value_mask: Tensor | None = None
    values_seen: Tensor | None = None
    targets: Tensor | None = None
    old_values: Tensor | None = None
    values_after: Tensor | None = None

    _ON_ACTIONS = ("logprobs", "rollout_logprobs", "advantages", "entropy", "staleness", "lm_weights")
    _ON_VALUES = ("values_seen", "targets", "old_values", "values_after")

    def rows(self) -> StepRecord:
        """The same values as rows of one token each (``[N, 1]``, masks all ones), detached, on
        the CPU: what the sharded learner gathers."""
        def pick(x: Tensor | None, mask: Tensor | None) -> Tensor | None:
            if x is None or mask is None:
                return None
            keep = x.detach()[mask.bool()]
            return (keep if keep.dtype == torch.long else keep.float()).cpu()[:, None]

        out = {name: pick(getattr(self, name), self.action_mask) for name in self._ON_ACTIONS}
        out |= {name: pick(getattr(self, name), self.value_mask) for name in self._ON_VALUES}
        act = torch.ones(int(self.action_mask.sum()), 1)
        vals = torch.ones(int(self.value_mask.sum()), 1) if self.value_mask is not None else None
        return replace(self, action_mask=act, value_mask=vals, **out,
                       first_advantages=self.first_advantages.cpu(), returns=self.returns.cpu())

    @staticmethod
    def concat(records: list[StepRecord]) -> StepRecord:
        """Rows of several records (:meth:`rows`) as one, in the given order."""
        def cat(name: str) -> Tensor | None:
            parts = [getattr(r, name) for r in records]
            return None if parts[0] is None else torch.cat(parts)

        return StepRecord(**{f.name: cat(f.name) for f in fields(StepRecord)})


@dataclass(frozen=True)
class StepTotals:
    """A step's scalars over the whole batch (every rank's, summed)."""

    policy_loss: float
    action_tokens: float
    positions: float
    microbatches: int


def critic_step_metrics(rec: StepRecord, value_clip: float | None) -> dict[str, float]:
    """``critic/*``: the loss and explained variance before the step's updates (how well the
    critic predicted unseen data) and after them."""
    mask, targets = rec.value_mask, rec.targets
    clip = {"old_values": rec.old_values, "clip": value_clip} if value_clip else {}
    _, before = value_loss(rec.values_seen, targets, mask, **clip)
    _, after = value_loss(rec.values_after, targets, mask)
    return {
        "critic/value_loss": before["critic/value_loss"],
        "critic/value_loss_after": after["critic/value_loss"],
        "critic/explained_var": before["critic/explained_var"],
        "critic/explained_var_after": after["critic/explained_var"],
        "critic/value_mean": after["critic/value_mean"],
        "critic/return_mean": float(masked_mean(targets, mask)),
    }


def step_metrics(p: AlgoPreset, rec: StepRecord, totals: StepTotals) -> dict[str, Any]:
    """The metrics of a trainer step from the whole batch's record (see the module docstring)."""
    act, adv = rec.action_mask, rec.advantages
    metrics: dict[str, Any] = critic_step_metrics(rec, p.value_clip) if rec.value_mask is not None else {}
    adv_mean = masked_mean(adv, act)
    metrics["advantage/mean"] = float(adv_mean)
    metrics["advantage/std"] = float(masked_mean((adv - adv_mean) ** 2, act).sqrt())
    first = rec.first_advantages[:, None]
    metrics |= advantage_spread(first, rec.returns[:, None], torch.ones_like(first))
    behaviour = rec.rollout_logprobs if p.behaviour == "rollout" else rec.logprobs
    _, policy = POLICY_LOSSES[p.policy_loss](rec.logprobs, behaviour, adv, act, p.eps_low, p.eps_high)
    metrics |= policy
    metrics |= mismatch_metrics(rec.logprobs, rec.rollout_logprobs, act, rec.staleness, p.eps_low,
                                p.eps_high, advantages=adv)
    ratio = torch.exp(rec.logprobs - rec.rollout_logprobs)  # histogram: 24 log bins, 1e-2..1e2
    metrics["policy/ratio_hist"] = ratio_histogram(ratio, act)[0].tolist()
    if rec.lm_weights is not None:
        ones = torch.ones(rec.lm_weights.shape[0], device=rec.lm_weights.device)
        metrics["policy/lm_loss"] = float(lm_loss(rec.logprobs, rec.lm_weights, ones))
    loss = totals.policy_loss
    metrics["policy/loss"] = loss if math.isfinite(loss) else math.nan
    metrics["policy/entropy"] = float(masked_mean(rec.entropy, act))
    metrics["throughput/positions_per_action_token"] = totals.positions / max(totals.action_tokens, 1.0)
    metrics["throughput/microbatches"] = totals.microbatches
    return metrics
