"""One trainer update on a batch of finished trajectories: the SAO step and its baselines.

For a batch of ``B`` trajectories, with the algorithm preset ``p``:

1. critic (``p.use_critic``): ``p.critic_updates`` (K, default 2) optimizer steps on the same
   batch, regressing V on λ_critic returns (λ_critic = 1: Monte-Carlo along the action chain,
   independent of V). The critic's attention may be frozen (``p.freeze_critic_attention``).
2. values are recomputed with the *updated* critic, then advantages come from the estimator the
   preset names (skip-observation or token GAE with λ_policy / VAPO's length-adaptive λ, GRPO's
   group normalisation, or a running-mean baseline).
3. one policy step on the loss the preset names (DIS against the rollout logprobs, or PPO clip
   against them), plus VAPO's positive-example LM loss and an optional entropy bonus.

That is K + 1 critic forward passes (K with gradient, one without) and one policy pass: the
fewest the method allows. Monte-Carlo targets need no values, so no forward runs before the
updates (only value clipping or λ_critic < 1 add one); the values before the updates, for
``critic/value_loss``, are those of the first update's forward; the values after them serve both
the advantages and ``critic/*_after``.

**Micro-batches.** The per-token math (targets, advantages, loss masks) runs on the right-padded
``[B, T]`` batch; every model pass runs on token-budget micro-batches
(:mod:`saorl.data.packing`: packed end to end with per-sequence position ids, or padded), whose
results are scattered back into ``[B, T]``. Gradients accumulate across micro-batches, and each
micro-batch's loss is weighted by its share of the batch's denominator (its action tokens over
the batch's, for DIS / PPO, the entropy bonus and the value loss; its positive-trajectory action
tokens for the LM loss), so the update equals the one-pass update on the whole batch: the DIS
denominator is every action token of the batch, as in the method. Logged:
``throughput/positions_per_action_token`` (positions the model processed per action token:
padding and non-action tokens included) and ``throughput/microbatches``. The sharded learner
(:mod:`saorl.runtime.sharded`) runs these very passes on each rank's share; it differs only in
:meth:`Learner._token_total` (global counts), ``_backward`` and ``_optimizer_step``.

A loss, gradient or updated parameter that is not finite skips (rolls back) that optimizer step
(counted in ``train/nonfinite_skips``): it never reaches the weights. The policy version advances
only when the policy weights change.

**Routing replay** (``routing_replay``, MoE policies): the policy's forward routes every token to
the experts the engine recorded for it (``Trajectory.routes``; ``saorl.models.routing``), so an
engine that routed differently (other numerics, a perturbation) is scored as it sampled.

Log-probabilities are scored under the sampler's own distribution: the rollout temperature and,
when the engine truncates (``top_k`` / ``top_p``), the same truncation, so the DIS ratio compares
like with like (:func:`saorl.models.logprobs.token_logprobs`). Where each step's time goes is in
:attr:`Learner.timings` (collate, critic and policy forward / backward, advantages).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from saorl.algo.advantages import RunningMeanBaseline
from saorl.algo.diagnostics import advantage_spread, mismatch_metrics
from saorl.algo.gae import value_targets
from saorl.algo.losses import lm_loss, masked_mean, ratio_histogram, value_loss
from saorl.algo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageInputs, AlgoPreset
from saorl.data.batch import Batch, collate
from saorl.data.packing import MicroBatch, microbatches
from saorl.data.trajectory import Trajectory
from saorl.models.logprobs import token_logprobs
from saorl.models.packed import use_varlen_attention
from saorl.models.routing import num_moe_layers, replay_routes
from saorl.runtime.checkpoint import load_learner_files, save_learner_files
from saorl.runtime.nonfinite import params_finite, roll_back, snapshot
from saorl.runtime.observe import Timings
from saorl.runtime.weights import WeightSync

Tensor = torch.Tensor


@dataclass
class OptimConfig:
    policy_lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    """Linear learning-rate warm-up (policy and critic) over this many trainer steps."""


def _backward(loss: Tensor) -> None:
    """Accumulate one micro-batch's gradients (a non-finite loss is left out: the step is skipped)."""
    if loss.requires_grad and torch.isfinite(loss):
        loss.backward()


def _finite_step(params, optimizer: torch.optim.Optimizer, loss: Tensor, clip: float) -> float | None:
    """Clipped step on the gradients accumulated for ``loss`` (the whole batch's loss, summed over
    micro-batches); returns the grad norm, or None — no step, gradients cleared — if the loss or
    the norm is not finite.

    A step that leaves a parameter non-finite is rolled back (:mod:`saorl.runtime.nonfinite`),
    and None is returned as well: a non-finite value never reaches the weights.
    """
    if not torch.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        return None
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return None
    saved = snapshot(params, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if params_finite(params):
        return float(norm)
    roll_back(params, optimizer, saved)
    return None


def _share(part: Tensor, total: Tensor) -> Tensor:
    """A micro-batch's share of a batch-wide token-mean denominator (``total``, from
    :meth:`Learner._token_total`)."""
    return part.sum() / total


class Learner:
    """Holds the policy, the critic and their optimizers; ``step`` is one trainer update.

    ``max_tokens_per_microbatch`` is the token budget of one model pass and ``packing`` its
    layout (see "Micro-batches" in the module docstring). With packing, a model using ``sdpa``
    is switched to ``sdpa_varlen`` in place (:func:`saorl.models.packed.use_varlen_attention`):
    identical outside packed rows, one causal attention per sequence inside them.
    """

    def __init__(self, policy: torch.nn.Module, critic: torch.nn.Module | None, preset: AlgoPreset,
                 optim: OptimConfig, *, pad_id: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, device: str = "cpu", max_tokens_per_microbatch: int = 4096,
                 packing: bool = True) -> None:
        self.policy, self.critic, self.preset, self.optim = policy, critic, preset, optim
        self.pad_id, self.device = pad_id, device
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_k, self.top_p = top_k, top_p
        self.max_tokens, self.packing = max_tokens_per_microbatch, packing
        self.timings = Timings()
        if preset.use_critic and critic is None:
            raise ValueError(f"algorithm {preset.name!r} needs a critic")
        if preset.routing_replay and not num_moe_layers(policy):
            raise ValueError(f"algo.routing_replay needs an MoE policy; {type(policy).__name__} "
                             "routes no tokens")
        if packing:
            use_varlen_attention(policy)
        self.policy_params = [p for p in policy.parameters() if p.requires_grad]
        self.policy_opt = torch.optim.AdamW(self.policy_params, lr=optim.policy_lr,
                                            weight_decay=optim.weight_decay)
        self.critic_opt = None
        if preset.use_critic:
            critic.set_frozen_attention(preset.freeze_critic_attention)
            if packing:
                use_varlen_attention(critic.trunk)
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

    # ------------------------------------- what the sharded learner does across its ranks
    def _token_total(self, mask: Tensor) -> Tensor:
        """The denominator of a token mean over the batch (``mask``'s sum, 0 counts as 1)."""
        return mask.sum().clamp(min=1)

    def _backward(self, loss: Tensor) -> None:
        """Accumulate one micro-batch's gradients."""
        _backward(loss)

    def _optimizer_step(self, params, optimizer: torch.optim.Optimizer, total: Tensor) -> float | None:
        """The step on the accumulated gradients (``total``: the batch's loss); None if skipped."""
        return _finite_step(params, optimizer, total, self.optim.grad_clip)

    # ----------------------------------------------------------------- critic
    def _values(self, batch: Batch, micro: list[MicroBatch]) -> Tensor:
        """The critic's values ``[B, T]`` over ``micro``, no gradient."""
        with torch.no_grad(), self.timings.span("critic forward (no grad)"):
            out = torch.zeros_like(batch.rewards)
            for mb in micro:
                mb.scatter(self.critic(mb.input_ids, **mb.model_args()), out)
        return out

    def _critic_pass(self, batch: Batch, micro: list[MicroBatch], targets: Tensor, mask: Tensor,
                     old_values: Tensor | None) -> tuple[Tensor, Tensor]:
        """One critic update, gradients accumulated over ``micro``; returns the values ``[B, T]``
        it saw (before its optimizer step) and the batch's loss."""
        p = self.preset
        values = torch.zeros_like(batch.rewards)
        total = torch.zeros((), device=values.device)
        whole = self._token_total(mask)
        self.critic_opt.zero_grad(set_to_none=True)
        for mb in micro:
            m = mb.gather(mask)
            clip = {"old_values": mb.gather(old_values), "clip": p.value_clip} if p.value_clip else {}
            with self.timings.span("critic forward (grad)"):
                v = self.critic(mb.input_ids, **mb.model_args())
                loss = value_loss(v, mb.gather(targets), m, **clip)[0] * _share(m, whole)
            with self.timings.span("critic backward + optimizer"):
                self._backward(loss)
            total = total + loss.detach()
            mb.scatter(v.detach(), values)
        with self.timings.span("critic backward + optimizer"):
            if self._optimizer_step(self.critic_params, self.critic_opt, total) is None:
                self.nonfinite_skips += 1
        return values, total

    def _critic_updates(self, batch: Batch, micro: list[MicroBatch]) -> tuple[dict[str, float], Tensor]:
        """K critic steps; returns metrics and the values ``[B, T]`` the advantages use: the updated
        critic's, or with ``advantage_values = before_update`` the critic's before this batch's
        updates (those of the first update's forward).

        ``critic/value_loss`` and ``critic/explained_var`` describe the critic *before* this
        batch's updates (how well it predicted unseen data); ``*_after`` after them.
        """
        p = self.preset
        # Monte-Carlo targets (λ_critic = 1) need no values: skip that forward pass
        needs_old = bool(p.value_clip) or p.lam_critic != 1.0
        old_values = self._values(batch, micro) if needs_old else None
        targets, mask = value_targets(batch.rewards, old_values, batch.action_mask, batch.response_mask,
                                      gamma=p.gamma, lam=p.lam_critic, skip_observation=p.skip_observation)
        clip = {"old_values": old_values, "clip": p.value_clip} if p.value_clip else {}
        self.critic.train()
        before: dict[str, float] | None = None
        first: Tensor | None = None
        for _ in range(p.critic_updates):
            seen, _ = self._critic_pass(batch, micro, targets, mask, old_values)
            if before is None:
                first, before = seen, value_loss(seen, targets, mask, **clip)[1]
        self.critic.eval()
        after = self._values(batch, micro)
        _, after_metrics = value_loss(after, targets, mask)
        return {
            "critic/value_loss": before["critic/value_loss"],
            "critic/value_loss_after": after_metrics["critic/value_loss"],
            "critic/explained_var": before["critic/explained_var"],
            "critic/explained_var_after": after_metrics["critic/explained_var"],
            "critic/value_mean": after_metrics["critic/value_mean"],
            "critic/return_mean": float(masked_mean(targets, mask)),
        }, first if p.advantage_values == "before_update" else after

    # ----------------------------------------------------------------- policy
    def _advantages(self, batch: Batch, values: Tensor | None, gids: Tensor) -> tuple[Tensor, dict]:
        p = self.preset
        with self.timings.span("advantages"):
            advantages, _ = ADVANTAGE_ESTIMATORS[p.advantage](AdvantageInputs(
                rewards=batch.rewards, action_mask=batch.action_mask, gamma=p.gamma, lam=p.lam_policy,
                lam_alpha=p.vapo_alpha, values=values, response_mask=batch.response_mask,
                skip_observation=p.skip_observation, group_ids=gids, baseline=self.baseline))
        advantages = advantages * batch.action_mask
        adv_mean = masked_mean(advantages, batch.action_mask)
        adv_var = masked_mean((advantages - adv_mean) ** 2, batch.action_mask)
        metrics = {"advantage/mean": float(adv_mean), "advantage/std": float(adv_var.sqrt())}
        metrics |= advantage_spread(advantages, batch.rewards, batch.action_mask)
        if p.advantage == "running_mean":
            metrics["advantage/baseline"] = float(self.baseline.value)
        return advantages, metrics

    def _micro_policy_loss(self, mb: MicroBatch, batch: Batch, logprobs: Tensor, entropy: Tensor,
                           advantages: Tensor, lm_tokens: Tensor | None, totals: tuple) -> Tensor:
        """This micro-batch's part of the batch's policy loss (see "Micro-batches"); ``totals``: the
        action tokens' and ``lm_tokens``' denominators."""
        p = self.preset
        act = mb.gather(batch.action_mask)
        share = _share(act, totals[0])
        # behaviour "trainer": the step's own log-probs, detached (ratio 1: nothing corrected)
        behaviour = mb.gather(batch.rollout_logprobs) if p.behaviour == "rollout" else logprobs.detach()
        loss, _ = POLICY_LOSSES[p.policy_loss](logprobs, behaviour, mb.gather(advantages), act, p.eps_low,
                                               p.eps_high)
        loss = loss * share
        if p.entropy_coef:
            loss = loss - p.entropy_coef * masked_mean(entropy, act) * share
        if lm_tokens is not None:
            w = mb.gather(lm_tokens)  # the LM loss's own denominator: positive trajectories' actions
            lm = lm_loss(logprobs, w, torch.ones(w.shape[0], device=w.device))
            loss = loss + p.lm_loss_coef * lm * _share(w, totals[1])
        return loss

    def _replayed(self, batch: Batch, mb: MicroBatch):
        """With ``routing_replay``: route the policy's forward on ``mb`` as the engine did."""
        if not self.preset.routing_replay or batch.routes is None:
            return contextlib.nullcontext()
        routes = mb.gather(batch.routes)
        layers = num_moe_layers(self.policy)
        return replay_routes(self.policy, routes.reshape(*routes.shape[:2], layers, -1))

    def _policy_passes(self, batch: Batch, micro: list[MicroBatch], advantages: Tensor,
                       lm_tokens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The policy's forward and backward over ``micro``, gradients accumulated (no optimizer
        step); returns its log-probs and entropies ``[B, T]`` and the batch's loss."""
        logprobs, entropy = torch.zeros_like(batch.rewards), torch.zeros_like(batch.rewards)
        totals = (self._token_total(batch.action_mask),
                  self._token_total(lm_tokens) if lm_tokens is not None else None)
        total = torch.zeros((), device=logprobs.device)
        self.policy.train()
        self.policy_opt.zero_grad(set_to_none=True)
        for mb in micro:
            with self.timings.span("policy forward"), self._replayed(batch, mb):
                lp, ent = token_logprobs(self.policy, mb.input_ids, temperature=self.temperature,
                                         top_k=self.top_k, top_p=self.top_p, return_entropy=True,
                                         **mb.model_args())
                loss = self._micro_policy_loss(mb, batch, lp, ent, advantages, lm_tokens, totals)
            with self.timings.span("policy backward + optimizer"):
                self._backward(loss)
            total = total + loss.detach()
            mb.scatter(lp.detach(), logprobs)
            mb.scatter(ent.detach(), entropy)
        return logprobs, entropy, total

    def _policy_update(self, batch: Batch, micro: list[MicroBatch], advantages: Tensor,
                       trajectories: list[Trajectory]) -> dict[str, float]:
        p = self.preset
        positive = lm_tokens = None
        if p.lm_loss_coef:
            positive = torch.tensor([float(t.episode.success) for t in trajectories],
                                    device=batch.rewards.device)
            lm_tokens = positive[:, None] * batch.action_mask
        logprobs, entropy, total = self._policy_passes(batch, micro, advantages, lm_tokens)
        behaviour = batch.rollout_logprobs if p.behaviour == "rollout" else logprobs
        _, metrics = POLICY_LOSSES[p.policy_loss](logprobs, behaviour, advantages, batch.action_mask,
                                                  p.eps_low, p.eps_high)
        metrics |= mismatch_metrics(logprobs, batch.rollout_logprobs, batch.action_mask,
                                    self.version - batch.versions, p.eps_low, p.eps_high,
                                    advantages=advantages)
        ratio = torch.exp(logprobs - batch.rollout_logprobs)  # histogram: 24 log bins, 1e-2..1e2
        metrics["policy/ratio_hist"] = ratio_histogram(ratio, batch.action_mask)[0].tolist()
        if positive is not None:
            metrics["policy/lm_loss"] = float(lm_loss(logprobs, batch.action_mask, positive))
        norm = self._policy_step(total)
        if norm is not None:
            metrics["policy/grad_norm"] = norm
        metrics["policy/loss"] = float(total) if torch.isfinite(total) else math.nan
        metrics["policy/entropy"] = float(masked_mean(entropy, batch.action_mask))
        return metrics

    def _policy_step(self, total: Tensor) -> float | None:
        """The optimizer step on the policy's accumulated gradients: a new version, or (non-finite)
        a skipped step counted in ``nonfinite_skips``; returns the grad norm or None."""
        with self.timings.span("policy backward + optimizer"):
            norm = self._optimizer_step(self.policy_params, self.policy_opt, total)
        self.policy.eval()
        if norm is None:
            self.nonfinite_skips += 1
        else:
            self.version += 1
        return norm

    def step(self, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> dict[str, float]:
        if not trajectories:
            raise ValueError("Learner.step needs at least one trajectory")
        with self.timings.span("collate"):
            batch = collate(trajectories, self.pad_id).to(self.device)
            micro = microbatches(batch, self.max_tokens, self.packing)
        self._apply_warmup()
        self.steps_done += 1
        actions = max(float(batch.action_mask.sum()), 1.0)
        metrics: dict[str, float] = {
            "policy/lr": self.policy_opt.param_groups[0]["lr"],
            "throughput/positions_per_action_token": sum(mb.positions for mb in micro) / actions,
            "throughput/microbatches": len(micro)}
        values = None
        if self.preset.use_critic:
            critic_metrics, values = self._critic_updates(batch, micro)
            metrics |= critic_metrics
        gids = torch.tensor(group_ids if group_ids is not None else range(len(trajectories)),
                            device=batch.input_ids.device)
        advantages, adv_metrics = self._advantages(batch, values, gids)
        metrics |= adv_metrics
        metrics |= self._policy_update(batch, micro, advantages, trajectories)
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
