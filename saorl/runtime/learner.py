"""One trainer update on a batch of finished trajectories: the SAO step and its baselines.

For a batch of ``B`` trajectories (padded to ``[B, T]``), with the algorithm preset ``p``:

1. critic (``p.use_critic``): ``p.critic_updates`` (K, default 2) optimizer steps on the same
   batch, regressing V on λ_critic returns (λ_critic = 1: Monte-Carlo along the action chain,
   independent of V). The critic's attention may be frozen (``p.freeze_critic_attention``).
2. values are recomputed with the *updated* critic, then advantages come from the estimator the
   preset names (skip-observation or token GAE with λ_policy / VAPO's length-adaptive λ, GRPO's
   group normalisation, or a running-mean baseline).
3. one policy step on the loss the preset names (DIS against the rollout logprobs, or PPO clip
   against them), plus VAPO's positive-example LM loss and an optional entropy bonus.

A loss or gradient that is not finite skips that optimizer step (counted in
``train/nonfinite_skips``) and never reaches the weights. The policy version advances only when
the policy weights change.

Log-probabilities are scored under the sampler's own distribution: the rollout temperature and,
when the engine truncates (``top_k`` / ``top_p``), the same truncation, so the DIS ratio compares
like with like (:func:`saorl.models.logprobs.token_logprobs`). Where each step's time goes is in
:attr:`Learner.timings` (collate, critic and policy forward / backward, advantages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from saorl.algo.advantages import RunningMeanBaseline
from saorl.algo.diagnostics import mismatch_metrics
from saorl.algo.gae import value_targets
from saorl.algo.losses import lm_loss, masked_mean, ratio_histogram, value_loss
from saorl.algo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageInputs, AlgoPreset
from saorl.data.batch import Batch, collate
from saorl.data.trajectory import Trajectory
from saorl.models.logprobs import token_logprobs
from saorl.runtime.checkpoint import load_learner_files, save_learner_files
from saorl.runtime.observe import Timings
from saorl.runtime.weights import WeightSync


@dataclass
class OptimConfig:
    policy_lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    """Linear learning-rate warm-up (policy and critic) over this many trainer steps."""


def _finite_step(params, optimizer: torch.optim.Optimizer, loss: torch.Tensor, clip: float) -> float | None:
    """Backward + clipped step; returns the grad norm, or None if anything was not finite."""
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return None
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


class Learner:
    """Holds the policy, the critic and their optimizers; ``step`` is one trainer update."""

    def __init__(self, policy: torch.nn.Module, critic: torch.nn.Module | None, preset: AlgoPreset,
                 optim: OptimConfig, *, pad_id: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, device: str = "cpu") -> None:
        self.policy, self.critic, self.preset, self.optim = policy, critic, preset, optim
        self.pad_id, self.device = pad_id, device
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_k, self.top_p = top_k, top_p
        self.timings = Timings()
        if preset.use_critic and critic is None:
            raise ValueError(f"algorithm {preset.name!r} needs a critic")
        self.policy_params = [p for p in policy.parameters() if p.requires_grad]
        self.policy_opt = torch.optim.AdamW(self.policy_params, lr=optim.policy_lr,
                                            weight_decay=optim.weight_decay)
        self.critic_opt = None
        if preset.use_critic:
            critic.set_frozen_attention(preset.freeze_critic_attention)
            self.critic_params = [p for p in critic.parameters() if p.requires_grad]
            self.critic_opt = torch.optim.AdamW(self.critic_params, lr=optim.critic_lr,
                                                weight_decay=optim.weight_decay)
        self.baseline = RunningMeanBaseline(preset.baseline_momentum)
        self.version = 0
        self.steps_done = 0
        self.nonfinite_skips = 0

    def _apply_warmup(self) -> None:
        scale = min(1.0, (self.steps_done + 1) / self.optim.warmup_steps) if self.optim.warmup_steps else 1.0
        for opt, lr in ((self.policy_opt, self.optim.policy_lr), (self.critic_opt, self.optim.critic_lr)):
            if opt is not None:
                for g in opt.param_groups:
                    g["lr"] = lr * scale

    # ----------------------------------------------------------------- critic
    def _values(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad(), self.timings.span("critic forward (no grad)"):
            return self.critic(batch.input_ids, batch.attention_mask)

    def _critic_updates(self, batch: Batch) -> tuple[dict[str, float], torch.Tensor]:
        """K critic steps; returns metrics and the updated critic's values ``[B, T]``.

        ``critic/value_loss`` and ``critic/explained_var`` describe the critic *before* this
        batch's updates (how well it predicted unseen data); ``*_after`` after them.
        """
        p = self.preset
        # Monte-Carlo targets (λ_critic = 1) need no values: skip that forward pass
        needs_old = bool(p.value_clip) or p.lam_critic != 1.0
        old_values = self._values(batch) if needs_old else None
        targets, mask = value_targets(batch.rewards, old_values, batch.action_mask, batch.response_mask,
                                      gamma=p.gamma, lam=p.lam_critic, skip_observation=p.skip_observation)
        clip = {"old_values": old_values, "clip": p.value_clip} if p.value_clip else {}
        self.critic.train()
        before: dict[str, float] | None = None
        for _ in range(p.critic_updates):
            with self.timings.span("critic forward (grad)"):
                values = self.critic(batch.input_ids, batch.attention_mask)
            loss, metrics = value_loss(values, targets, mask, **clip)
            before = metrics if before is None else before
            with self.timings.span("critic backward + optimizer"):
                norm = _finite_step(self.critic_params, self.critic_opt, loss, self.optim.grad_clip)
            if norm is None:
                self.nonfinite_skips += 1
        self.critic.eval()
        after = self._values(batch)
        _, after_metrics = value_loss(after, targets, mask)
        return {
            "critic/value_loss": before["critic/value_loss"],
            "critic/value_loss_after": after_metrics["critic/value_loss"],
            "critic/explained_var": before["critic/explained_var"],
            "critic/explained_var_after": after_metrics["critic/explained_var"],
            "critic/value_mean": after_metrics["critic/value_mean"],
            "critic/return_mean": float(masked_mean(targets, mask)),
        }, after

    # ----------------------------------------------------------------- policy
    def step(self, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> dict[str, float]:
        if not trajectories:
            raise ValueError("Learner.step needs at least one trajectory")
        p = self.preset
        with self.timings.span("collate"):
            batch = collate(trajectories, self.pad_id).to(self.device)
        self._apply_warmup()
        self.steps_done += 1
        metrics: dict[str, float] = {"policy/lr": self.policy_opt.param_groups[0]["lr"]}
        values = None
        if p.use_critic:
            critic_metrics, values = self._critic_updates(batch)
            metrics |= critic_metrics
        gids = torch.tensor(group_ids if group_ids is not None else range(len(trajectories)),
                            device=batch.input_ids.device)
        with self.timings.span("advantages"):
            advantages, _ = ADVANTAGE_ESTIMATORS[p.advantage](AdvantageInputs(
                rewards=batch.rewards, action_mask=batch.action_mask, gamma=p.gamma, lam=p.lam_policy,
                lam_alpha=p.vapo_alpha, values=values, response_mask=batch.response_mask,
                skip_observation=p.skip_observation, group_ids=gids, baseline=self.baseline))
        advantages = advantages * batch.action_mask
        adv_mean = masked_mean(advantages, batch.action_mask)
        metrics["advantage/mean"] = float(adv_mean)
        metrics["advantage/std"] = float(masked_mean((advantages - adv_mean) ** 2, batch.action_mask).sqrt())
        if p.advantage == "running_mean":
            metrics["advantage/baseline"] = float(self.baseline.value)

        self.policy.train()
        with self.timings.span("policy forward"):
            logprobs, entropy = token_logprobs(self.policy, batch.input_ids, batch.attention_mask,
                                               temperature=self.temperature, top_k=self.top_k,
                                               top_p=self.top_p, return_entropy=True)
        # behaviour "trainer": the step's own log-probs, detached (ratio 1: nothing corrected)
        behaviour = batch.rollout_logprobs if p.behaviour == "rollout" else logprobs.detach()
        loss, pol_metrics = POLICY_LOSSES[p.policy_loss](
            logprobs, behaviour, advantages, batch.action_mask, p.eps_low, p.eps_high)
        metrics |= pol_metrics
        metrics |= mismatch_metrics(logprobs.detach(), batch.rollout_logprobs, batch.action_mask,
                                    self.version - batch.versions, p.eps_low, p.eps_high)
        with torch.no_grad():  # the ratio histogram every step (24 log-spaced bins, 1e-2..1e2)
            ratio = torch.exp(logprobs.detach() - batch.rollout_logprobs)
            metrics["policy/ratio_hist"] = ratio_histogram(ratio, batch.action_mask)[0].tolist()
        mean_entropy = masked_mean(entropy, batch.action_mask)
        if p.entropy_coef:
            loss = loss - p.entropy_coef * mean_entropy
        if p.lm_loss_coef:
            positive = torch.tensor([float(t.episode.success) for t in trajectories], device=logprobs.device)
            lm = lm_loss(logprobs, batch.action_mask, positive)
            loss = loss + p.lm_loss_coef * lm
            metrics["policy/lm_loss"] = float(lm.detach())
        with self.timings.span("policy backward + optimizer"):
            norm = _finite_step(self.policy_params, self.policy_opt, loss, self.optim.grad_clip)
        self.policy.eval()
        if norm is None:
            self.nonfinite_skips += 1
        else:
            self.version += 1
            metrics["policy/grad_norm"] = norm
        metrics["policy/loss"] = float(loss.detach()) if torch.isfinite(loss) else math.nan
        metrics["policy/entropy"] = float(mean_entropy.detach())
        metrics["policy/version"] = self.version
        metrics["train/nonfinite_skips"] = self.nonfinite_skips
        return metrics

    # ------------------------------------------------- weights out, checkpoints
    def policy_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.policy.state_dict().items()}

    def publish(self, sync: WeightSync) -> None:
        """Publish the policy's current weights as version :attr:`version`."""
        sync.publish(self.policy_state(), self.version)

    def full_models(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """Plain (unsharded) policy and critic holding the current weights, for evaluation and export."""
        return self.policy, self.critic

    def save_state(self, directory: Path) -> dict:
        """Write weights and optimizer states into ``directory``; the checkpoint manifest's entries."""
        critic = self.critic is not None
        return save_learner_files(directory, self.policy_state(), self.policy_opt.state_dict(),
                                  self.critic.state_dict() if critic else None,
                                  self.critic_opt.state_dict() if critic else None)

    def load_state(self, directory: Path, manifest: dict) -> None:
        """Restore what :meth:`save_state` wrote (the counters are the checkpoint's business)."""
        policy, policy_optim, critic, critic_optim = load_learner_files(directory, manifest)
        self.policy.load_state_dict(policy)
        self.policy_opt.load_state_dict(policy_optim)
        if self.critic is not None and critic is not None:
            self.critic.load_state_dict(critic)
            self.critic_opt.load_state_dict(critic_optim)
