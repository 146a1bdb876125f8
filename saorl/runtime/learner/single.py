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
fewest the method allows. With ``algo.critic_train_layers = N`` the critic's frozen lower blocks
run once per micro-batch, under ``no_grad``, and those K + 1 passes run only its top N blocks
from their output (:class:`~saorl.models.critic.Critic`; timed as ``critic lower blocks``).
Monte-Carlo targets need no values, so no forward runs before the updates (only value clipping
or λ_critic < 1 add one); the values before the updates, for
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
padding and non-action tokens included) and ``throughput/microbatches``.

**One step for both learners.** :meth:`Learner.step` runs the passes over this process's share
of the batch (all of it here), fills one :class:`~saorl.runtime.learner.step_record.StepRecord` with the
per-token values they produced, gathers it (the identity here) and computes every metric with
one function (:func:`~saorl.runtime.learner.step_record.step_metrics`). Every optimizer step goes through
the routine SFT and value pretraining use too (:func:`saorl.runtime.learner.optimize.update`: accumulate
over the micro-batches, then a step taken only if it stays finite). What crosses ranks is the
:class:`~saorl.runtime.learner.optimize.Updater`'s business: the sharded learner
(:mod:`saorl.runtime.learner.sharded`) runs this very step on each rank's share with the sharded updater
(global counts, idle passes, a skip decided on every rank, the gather of the records to rank 0)
and overrides only the share split.

A loss, gradient or updated parameter that is not finite skips that optimizer step (tried on
copies, never taken; ``train/nonfinite_skips``). The policy version advances only when the policy
weights change.

**Routing replay** (``routing_replay``, MoE policies): the policy's forward routes every token to
the experts the engine recorded for it (``Trajectory.routes``; ``saorl.models.routing``), so an
engine that routed differently (other numerics, a perturbation) is scored as it sampled.

**LoRA** (``model.lora``; :mod:`saorl.models.lora`): a peft-wrapped policy trains its adapter
alone: only the adapter's parameters have ``requires_grad``, so the optimizer, the clipping and
the non-finite guard hold them and nothing else; :meth:`Learner.publish` publishes the adapter
alone (``WeightNames.adapter``) and a checkpoint holds the adapter and its optimizer
state, never the base. A LoRA critic (``model.lora.critic``) trains its adapter and value head
(:meth:`~saorl.models.critic.Critic.set_frozen_attention`); its checkpoint is the whole critic.

Log-probabilities are scored under the sampler's own distribution: the rollout temperature and,
when the engine truncates (``top_k`` / ``top_p``), the same truncation, so the DIS ratio compares
like with like (:func:`saorl.models.logprobs.token_logprobs`). Where each step's time goes is in
:attr:`Learner.timings` (collate, critic and policy forward / backward, advantages).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from saorl.algo.advantages import RunningMeanBaseline
from saorl.algo.diagnostics import first_action_advantages
from saorl.algo.gae import value_targets
from saorl.algo.losses import lm_loss, masked_mean, value_loss
from saorl.algo.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    AlgoPreset,
    keeps_running_baseline,
)
from saorl.data.batch import Batch
from saorl.data.packing import MicroBatch
from saorl.data.trajectory import Trajectory, training_rows
from saorl.models.logprobs import token_logprobs
from saorl.models.lora import adapter_config, adapter_state, is_lora, load_adapter_state
from saorl.models.packed import honours_shared_prefix, use_varlen_attention
from saorl.models.routing import num_moe_layers, replay_routes
from saorl.runtime.learner.optimize import Updater, prepare_share, share_of, update
from saorl.runtime.learner.state_files import load_learner_files, save_learner_files
from saorl.runtime.learner.step_record import (
    LearnerCounters,
    StepRecord,
    StepResult,
    StepTotals,
    step_metrics,
)
from saorl.runtime.learner.timings import Timings
from saorl.runtime.weights.base import MODEL_NAMES, WeightNames, WeightPublisher

Tensor = torch.Tensor


@dataclass
class OptimConfig:
    """The optimizer settings of the learner: ``trainer.*`` fields of the same names
    (:meth:`from_trainer`)."""

    policy_lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    """Linear learning-rate warm-up (policy and critic) over this many trainer steps (the
    policy's counted from its first update, after any critic warm-up)."""
    critic_warmup_steps: int = 0
    critic_warmup: str = "steps"
    """``steps``: the first ``critic_warmup_steps`` steps train the critic alone (the policy scored,
    not updated: its version stays). ``lr``: the critic's rate at step k × min(1, k / those steps)."""
    staleness_lr_ref: float | None = None
    """The policy's rate is scaled by ``min(1, ref / mean staleness of the batch)`` (None: off)."""

    @classmethod
    def from_trainer(cls, trainer: Any) -> OptimConfig:
        """The fields of the ``trainer`` config section named as this record's, by name."""
        return cls(**{f.name: getattr(trainer, f.name) for f in dataclasses.fields(cls)})


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
                 packing: bool = True, updater: Updater | None = None, shared_prefix: bool = True) -> None:
        self.policy, self.critic, self.preset, self.optim = policy, critic, preset, optim
        self.updater = updater if updater is not None else Updater()
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
        self.lora = is_lora(policy)
        """A LoRA policy (:mod:`saorl.models.lora`): only its adapter trains, is published and saved."""
        self.policy_params = [p for p in policy.parameters() if p.requires_grad]
        self.policy_opt = torch.optim.AdamW(self.policy_params, lr=optim.policy_lr,
                                            weight_decay=optim.weight_decay)
        self.critic_opt = None
        if preset.use_critic:
            critic.set_frozen_attention(preset.freeze_critic_attention, preset.critic_train_layers)
            if packing:
                use_varlen_attention(critic.trunk)
            self.critic_params = [p for p in critic.parameters() if p.requires_grad]
            self.critic_opt = torch.optim.AdamW(self.critic_params, lr=optim.critic_lr,
                                                weight_decay=optim.weight_decay)
        self.counters = LearnerCounters(RunningMeanBaseline(preset.baseline_momentum))
        models = [policy] + ([critic.trunk] if preset.use_critic else [])
        self.shared_prefix = (shared_prefix and packing and not preset.routing_replay
                              and all(honours_shared_prefix(m) for m in models))
        """Packed rows hold the batch's common prefix once (``trainer.shared_prefix``; only with
        ``sdpa_varlen`` attention, never with routing replay, whose routes are per row)."""

    # the counters (checkpointed as one record: :class:`~saorl.runtime.learner.step_record.LearnerCounters`)
    @property
    def version(self) -> int:
        return self.counters.version

    @version.setter
    def version(self, value: int) -> None:
        self.counters.version = value

    @property
    def steps_done(self) -> int:
        return self.counters.steps_done

    @property
    def nonfinite_skips(self) -> int:
        return self.counters.nonfinite_skips

    @property
    def baseline(self) -> RunningMeanBaseline:
        return self.counters.baseline

    def _apply_lr(self, staleness: Tensor, act: Tensor) -> None:
        """This step's learning rates: the warm-up's scale (policy and critic; the critic's ramp
        with ``critic_warmup = "lr"``) and, with
        ``staleness_lr_ref``, the policy's staleness scale from the whole batch's mean
        ``staleness`` over its action tokens ``act`` (summed across ranks, so every rank steps
        with the same rate)."""
        warm, critic_warm = self.optim.warmup_steps, self.optim.critic_warmup_steps
        scale = min(1.0, (self.steps_done + 1) / warm) if warm else 1.0
        by_lr = self.optim.critic_warmup == "lr"
        policy_steps = self.steps_done if by_lr else max(0, self.steps_done - critic_warm)  # its own so far
        policy_scale = min(1.0, (policy_steps + 1) / warm) if warm else 1.0
        ramp = min(1.0, (self.steps_done + 1) / critic_warm) if by_lr and critic_warm else 1.0
        if self.optim.staleness_lr_ref is not None:
            stale, count = self.updater.sum([float((staleness * act).sum()), float(act.sum())])
            if stale > 0:  # mean staleness stale / count; none (all fresh): the rate unchanged
                policy_scale *= min(1.0, self.optim.staleness_lr_ref * count / stale)
        for opt, lr in ((self.policy_opt, self.optim.policy_lr * policy_scale),
                        (self.critic_opt, self.optim.critic_lr * scale * ramp)):
            if opt is not None:
                for g in opt.param_groups:
                    g["lr"] = lr

    # ---------------------------------------- what crosses ranks: the updater's business
    def _totals(self, policy_loss: float, action_tokens: float, positions: float,
                microbatches: int) -> StepTotals:
        """The step's scalars over the whole batch (every rank's, summed: each rank's policy loss
        is weighted by the global count over the world size, :meth:`Updater.token_total`)."""
        loss, act, pos, micro = self.updater.sum([policy_loss, action_tokens, positions, float(microbatches)])
        return StepTotals(loss / self.updater.world, act, pos, int(micro))

    def _gather(self, record: StepRecord) -> StepRecord | None:
        """The whole batch's record where the metrics are computed: this one in one process,
        every rank's rows on rank 0 of a sharded learner (None on the others)."""
        if self.updater.world == 1:
            return record
        parts = self.updater.gather(record.rows())
        return StepRecord.concat(parts) if parts is not None else None

    # ----------------------------------------------------------------- critic
    def _critic_on(self, mb: MicroBatch, lower: dict[int, Tensor | None], span: str) -> Tensor:
        """The critic's values on ``mb`` (its forward timed as ``span``); with
        ``algo.critic_train_layers`` its frozen lower blocks' output is computed on the step's first
        pass over ``mb`` and reused from ``lower`` by every pass after it."""
        if id(mb) not in lower and self.critic.train_layers is None:
            lower[id(mb)] = None  # every block trains: the whole trunk runs each pass
        elif id(mb) not in lower:
            with self.timings.span("critic lower blocks (no grad, once)"):
                lower[id(mb)] = self.critic.frozen_hidden(mb.input_ids, **mb.model_args())
        with self.timings.span(span):
            return self.critic(mb.input_ids, **mb.model_args(), lower=lower[id(mb)])

    def _values(self, batch: Batch, micro: list[MicroBatch], lower: dict[int, Tensor | None]) -> Tensor:
        """The critic's values ``[B, T]`` over ``micro``, no gradient."""
        out = torch.zeros_like(batch.rewards)
        with torch.no_grad():
            for mb in micro:
                mb.scatter(self._critic_on(mb, lower, "critic forward (no grad)"), out)
        return out

    def _critic_pass(self, batch: Batch, micro: list[MicroBatch], targets: Tensor, mask: Tensor,
                     old_values: Tensor | None, lower: dict[int, Tensor | None]) -> tuple[Tensor, Tensor]:
        """One critic update, gradients accumulated over ``micro``; returns the values ``[B, T]``
        it saw (before its optimizer step) and the batch's loss."""
        p = self.preset
        values = torch.zeros_like(batch.rewards)
        whole = self.updater.token_total(mask)

        def loss_of(mb: MicroBatch) -> Tensor:
            m = mb.gather(mask)
            clip = {"old_values": mb.gather(old_values), "clip": p.value_clip} if p.value_clip else {}
            v = self._critic_on(mb, lower, "critic forward (grad)")
            loss = value_loss(v, mb.gather(targets), m, **clip)[0] * share_of(m, whole)
            mb.scatter(v.detach(), values)
            return loss

        total, norm = update(self.updater, self.critic_params, self.critic_opt, micro, loss_of,
                             self.optim.grad_clip, backward_span=self._span("critic backward + optimizer"))
        if norm is None:
            self.counters.nonfinite_skips += 1
        return values, total

    def _critic_updates(self, batch: Batch, micro: list[MicroBatch]) -> tuple[Tensor, dict[str, Tensor]]:
        """K critic steps; returns the values ``[B, T]`` the advantages use — the updated
        critic's, or with ``advantage_values = before_update`` the critic's before this batch's
        updates (those of the first update's forward) — and the record's critic columns.

        ``critic/value_loss`` and ``critic/explained_var`` describe the critic *before* this
        batch's updates (how well it predicted unseen data); ``*_after`` after them.
        """
        p = self.preset
        # Monte-Carlo targets (λ_critic = 1) need no values: skip that forward pass
        needs_old = bool(p.value_clip) or p.lam_critic != 1.0
        lower: dict[int, Tensor | None] = {}  # the frozen lower blocks' output per pass (top layers only)
        old_values = self._values(batch, micro, lower) if needs_old else None
        targets, mask = value_targets(batch.rewards, old_values, batch.action_mask, batch.response_mask,
                                      gamma=p.gamma, lam=p.lam_critic, skip_observation=p.skip_observation)
        self.critic.train()
        first: Tensor | None = None
        for _ in range(p.critic_updates):
            seen, _ = self._critic_pass(batch, micro, targets, mask, old_values, lower)
            first = seen if first is None else first
        self.critic.eval()
        after = self._values(batch, micro, lower)
        columns = {"value_mask": mask, "values_seen": first, "targets": targets, "old_values": old_values,
                   "values_after": after}
        return (first if p.advantage_values == "before_update" else after), columns

    # ----------------------------------------------------------------- policy
    def _advantages(self, batch: Batch, values: Tensor | None, gids: list[int], empty: bool) -> Tensor:
        """Per-token advantages ``[B, T]``, zero off the action tokens (``empty``: a share with no
        trajectory, which still joins the running-mean baseline's all-gather and the whitening's
        sums: every collective of a full share has its mirror here, which
        ``tests/runtime/learner/test_empty_share.py`` checks for every preset)."""
        p = self.preset
        gid = torch.tensor(gids, device=batch.input_ids.device)
        with self.timings.span("advantages"):
            if empty:
                if keeps_running_baseline(p.advantage):
                    self.baseline.update(torch.zeros(0))
                if p.advantage_norm == "batch":
                    self.updater.sum([0.0, 0.0, 0.0])  # joins the other ranks' sums
                return torch.zeros_like(batch.action_mask)
            advantages, _ = ADVANTAGE_ESTIMATORS[p.advantage](AdvantageInputs(
                rewards=batch.rewards, action_mask=batch.action_mask, gamma=p.gamma, lam=p.lam_policy,
                values=values, response_mask=batch.response_mask,
                skip_observation=p.skip_observation, group_ids=gid,
                baseline=self.baseline))
            advantages = advantages * batch.action_mask
            if p.advantage_norm == "batch":
                advantages = self._whitened(advantages, batch.action_mask)
        return advantages

    def _whitened(self, advantages: Tensor, act: Tensor) -> Tensor:
        """``algo.advantage_norm: batch``: the advantages less their mean over the batch's action
        tokens, over their standard deviation (population, + 1e-8); every rank's share counted."""
        a = advantages.double() * act
        n, total, squares = self.updater.sum([float(act.sum()), float(a.sum()), float((a * a).sum())])
        if n == 0:
            return advantages
        mean = total / n
        std = max(squares / n - mean * mean, 0.0) ** 0.5
        return ((advantages - mean) / (std + 1e-8)) * act

    def _micro_policy_loss(self, mb: MicroBatch, batch: Batch, logprobs: Tensor, entropy: Tensor,
                           advantages: Tensor, lm_tokens: Tensor | None, totals: tuple) -> Tensor:
        """This micro-batch's part of the batch's policy loss (see "Micro-batches"); ``totals``: the
        action tokens' and ``lm_tokens``' denominators."""
        p = self.preset
        act = mb.gather(batch.action_mask)
        share = share_of(act, totals[0])
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
            loss = loss + p.lm_loss_coef * lm * share_of(w, totals[1])
        return loss

    def _replayed(self, batch: Batch, mb: MicroBatch):
        """With ``routing_replay``: route the policy's forward on ``mb`` as the engine did."""
        if not self.preset.routing_replay or batch.routes is None:
            return contextlib.nullcontext()
        routes = mb.gather(batch.routes)
        layers = num_moe_layers(self.policy)
        return replay_routes(self.policy, routes.reshape(*routes.shape[:2], layers, -1))

    def _policy_scores(self, batch: Batch, micro: list[MicroBatch]) -> tuple[Tensor, Tensor]:
        """The policy's log-probs and entropies ``[B, T]`` over ``micro``, no gradient (a critic
        warm-up step: the metrics' DIS ratios and mismatch, with the policy left as it is)."""
        logprobs, entropy = torch.zeros_like(batch.rewards), torch.zeros_like(batch.rewards)
        with torch.no_grad():
            for mb in micro:
                with self.timings.span("policy forward"), self._replayed(batch, mb):
                    lp, ent = token_logprobs(self.policy, mb.input_ids, temperature=self.temperature,
                                             top_k=self.top_k, top_p=self.top_p, return_entropy=True,
                                             **mb.model_args())
                mb.scatter(lp, logprobs)
                mb.scatter(ent, entropy)
        return logprobs, entropy

    def _policy_update(self, batch: Batch, micro: list[MicroBatch], advantages: Tensor,
                       lm_tokens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, float | None]:
        """The policy's forward and backward over ``micro`` and its optimizer step: a new version,
        or (non-finite) a skipped step counted in ``nonfinite_skips``. Returns its log-probs and
        entropies ``[B, T]`` (before the step), the batch's loss and the grad norm (None: skipped)."""
        logprobs, entropy = torch.zeros_like(batch.rewards), torch.zeros_like(batch.rewards)
        totals = (self.updater.token_total(batch.action_mask),
                  self.updater.token_total(lm_tokens) if lm_tokens is not None else None)

        def loss_of(mb: MicroBatch) -> Tensor:
            with self.timings.span("policy forward"), self._replayed(batch, mb):
                lp, ent = token_logprobs(self.policy, mb.input_ids, temperature=self.temperature,
                                         top_k=self.top_k, top_p=self.top_p, return_entropy=True,
                                         **mb.model_args())
                loss = self._micro_policy_loss(mb, batch, lp, ent, advantages, lm_tokens, totals)
            mb.scatter(lp.detach(), logprobs)
            mb.scatter(ent.detach(), entropy)
            return loss

        self.policy.train()
        total, norm = update(self.updater, self.policy_params, self.policy_opt, micro, loss_of,
                             self.optim.grad_clip, backward_span=self._span("policy backward + optimizer"))
        self.policy.eval()
        if norm is None:
            self.counters.nonfinite_skips += 1
        else:
            self.counters.version += 1
        return logprobs, entropy, total, norm

    def _span(self, name: str):
        return lambda: self.timings.span(name)

    # ------------------------------------------------------------------- step
    def step(self, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> StepResult:
        """One trainer update on ``trajectories`` (``group_ids``: GRPO's groups, equal ids
        consecutive; None: each trajectory its own)."""
        if not trajectories:
            raise ValueError("Learner.step needs at least one trajectory")
        gids = list(group_ids) if group_ids is not None else list(range(len(trajectories)))
        return self._step_share(*training_rows(trajectories, gids))  # an episode's segments: rows

    def _step_share(self, trajs: list[Trajectory], gids: list[int]) -> StepResult | None:
        """The step on this process's share of the batch; the result where the metrics are
        gathered (None elsewhere). An empty share (a rank without trajectories) runs idle passes."""
        p = self.preset
        with self.timings.span("collate"):
            share = prepare_share(self.updater, trajs, self.pad_id, self.device, self.max_tokens,
                                  self.packing, self.shared_prefix)
        batch, micro, passes = share.batch, share.micro, share.passes
        act = batch.action_mask
        staleness = self.version - batch.versions  # before the update
        frozen = (p.use_critic and self.optim.critic_warmup == "steps"  # critic-only warm-up steps
                  and self.steps_done < self.optim.critic_warmup_steps)
        self._apply_lr(staleness, act)
        self.counters.steps_done += 1
        skips, lr = self.counters.nonfinite_skips, self.policy_opt.param_groups[0]["lr"]
        critic_lr = self.critic_opt.param_groups[0]["lr"] if self.critic_opt is not None else None
        values, critic_columns = self._critic_updates(batch, passes) if p.use_critic else (None, {})
        advantages = self._advantages(batch, values, gids, empty=not trajs)
        lm_tokens = None
        if p.lm_loss_coef:
            positive = torch.tensor([float(t.episode.success) for t in trajs] or [0.0], device=act.device)
            lm_tokens = positive[:, None] * act
        if frozen:  # the critic alone: the policy scored, not updated
            (logprobs, entropy), total, norm = self._policy_scores(batch, passes), torch.zeros(()), None
        else:
            logprobs, entropy, total, norm = self._policy_update(batch, passes, advantages, lm_tokens)
        record = StepRecord(act, logprobs, batch.rollout_logprobs, advantages, entropy, staleness, lm_tokens,
                            *first_action_advantages(advantages, batch.rewards, act), **critic_columns)
        totals = self._totals(float(total), float(act.sum()), float(sum(mb.positions for mb in micro)),
                              len(micro))
        whole = self._gather(record)
        if whole is None:
            return None
        metrics = {"policy/lr": lr, **step_metrics(p, whole, totals)}
        if keeps_running_baseline(p.advantage):
            metrics["advantage/baseline"] = float(self.baseline.value)
        if norm is not None:
            metrics["policy/grad_norm"] = norm
            metrics["policy/update_rel"] = self.updater.moved  # ‖Δθ‖ / ‖θ‖ of this step
        metrics["policy/version"] = self.version
        metrics["train/nonfinite_skips"] = self.nonfinite_skips
        if self.optim.critic_warmup_steps and self.critic_opt is not None:
            metrics["critic/warmup"] = float(frozen)
            metrics["critic/lr"] = critic_lr
        if frozen:  # no policy update: its loss and rate do not apply (null, never 0)
            metrics["policy/loss"] = metrics["policy/lr"] = math.nan
        return StepResult(metrics, skipped=self.nonfinite_skips > skips, version=self.version, frozen=frozen)

    # ------------------------------------------------- weights out, checkpoints
    def policy_state(self) -> dict[str, torch.Tensor]:
        """What the policy trains: its whole state dict, or a LoRA policy's adapter alone."""
        if self.lora:
            return adapter_state(self.policy)
        return {k: v.detach() for k, v in self.policy.state_dict().items()}

    def publish(self, sync: WeightPublisher) -> None:
        """Publish the policy's current weights (a LoRA policy: its adapter) as version :attr:`version`."""
        names = WeightNames.adapter(adapter_config(self.policy)) if self.lora else MODEL_NAMES
        sync.publish([self.policy_state()], self.version, names)

    def full_models(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """Plain (unsharded) policy and critic holding the current weights, for evaluation and export."""
        return self.policy, self.critic

    def save_state(self, directory: Path) -> dict:
        """Write weights and optimizer states into ``directory``; the checkpoint manifest's entries."""
        critic = self.critic is not None
        entries = save_learner_files(directory, self.policy_state(), self.policy_opt.state_dict(),
                                     self.critic.state_dict() if critic else None,
                                     self.critic_opt.state_dict() if critic else None)
        return entries | {"policy_weights": "lora_adapter" if self.lora else "full"}

    def load_state(self, directory: Path, manifest: dict) -> None:
        """Restore what :meth:`save_state` wrote, and the counters from the checkpoint's manifest."""
        policy, policy_optim, critic, critic_optim = load_learner_files(directory, manifest)
        saved = manifest.get("policy_weights", "full")
        if saved != ("lora_adapter" if self.lora else "full"):
            raise ValueError(f"checkpoint {str(directory)!r} holds the policy's "
                             f"{'LoRA adapter' if saved == 'lora_adapter' else 'full weights'}, but this "
                             f"learner trains {'a LoRA adapter' if self.lora else 'the full policy'}: "
                             "resume with the model.lora settings the run was started with")
        if self.lora:
            load_adapter_state(self.policy, policy)
        else:
            self.policy.load_state_dict(policy)
        self.policy_opt.load_state_dict(policy_optim)
        if self.critic is not None and critic is not None:
            mine = getattr(self.critic, "lora", False)
            if any(".lora_A." in k for k in critic) != mine:
                kinds = ("the default critic", "a LoRA critic")
                raise ValueError(f"checkpoint {str(directory)!r} holds {kinds[not mine]}, but this learner "
                                 f"trains {kinds[mine]}: resume with the model.lora.critic setting the run "
                                 "was started with")
            self.critic.load_state_dict(critic)
            self.critic_opt.load_state_dict(critic_optim)
        self.counters.restore(manifest)
