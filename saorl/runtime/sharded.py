"""The sharded learner: policy and critic under torch FSDP2 over the ranks of a ``torchrun`` launch.

``torchrun --standalone --nproc-per-node N -m saorl.cli train CONFIG trainer.shard=fsdp2``: every
rank runs ``saorl train``. Rank 0 does all a single-process run does (stages, feed, journal,
evaluation, checkpoints) with a :class:`ShardedLearner` as its learner; the other ranks build the
same learner on skeleton models (:mod:`saorl.runtime.shard_group`) and serve it
(:meth:`ShardedLearner.follow`) until rank 0 closes it.

**Commands.** Whatever needs the other ranks — a step, a publication, the full models, a
checkpoint save or load, the end — starts on rank 0 by broadcasting ``(name, args)`` on the
control channel; every rank then runs the same ``_all_<name>`` method, so the collectives inside
run in the same order everywhere.

**The step** equals a single-process :meth:`~saorl.runtime.learner.Learner.step` on the same
batch, up to float rounding:

1. rank 0 hands each rank its share: whole groups (GRPO's groups never split), greedily balanced
   by tokens.
2. Each rank cuts its share into token-budget micro-batches (``trainer.max_tokens_per_microbatch``,
   ``trainer.packing``) and runs every model pass on them with gradient accumulation — the very
   code of the single-process learner (its "Micro-batches": ``_values``, ``_critic_pass``,
   ``_policy_passes``), so a long batch fits in memory on every rank. Every loss is a token mean
   over the whole batch: a micro-batch's loss is weighted by its tokens over the **global** count
   (all-reduced once per loss), times the world size, because FSDP2 averages gradients over the
   ranks (:meth:`_token_total`); so the ranks' accumulated gradients add up to the global mean's.
   The counts: action tokens (policy loss, entropy), value-target tokens (critic), tokens of
   positive trajectories (VAPO's LM loss). FSDP2 all-gathers the parameters in every forward and
   reduce-scatters the gradients in every backward, collectives every rank must join, so every
   rank runs as many passes as the rank with the most micro-batches: the others add *idle* passes
   (:class:`~saorl.data.packing.IdleMicroBatch`, two padding tokens whose every mask is 0: a loss
   of exactly 0 with a graph through the whole model), a rank with no share runs idle passes
   only, and every rank runs every backward, even of a non-finite loss. Gradients are
   reduce-scattered after every micro-batch's backward, not held back with
   ``set_requires_gradient_sync(False)`` until the last: FSDP2 then accumulates *unsharded*
   gradients (a full-size gradient of every parameter on every rank), which defeats the memory
   that micro-batches and sharding save, and it would not spare the idle passes (the forward's
   all-gathers need them anyway).
3. A non-finite loss or gradient norm on any rank skips the update on every rank (all-reduced), so
   the ranks never diverge; so does an update that leaves a parameter shard non-finite on any
   rank: every rank rolls its shards back (:mod:`saorl.runtime.nonfinite`).
4. The running-mean baseline sees the scores of the whole batch (all-gathered): every rank keeps
   an identical baseline and takes its own trajectories' advantages.
5. Metrics: the per-token quantities on action and value-target tokens are gathered to rank 0,
   which computes every metric with the same functions the single-process learner uses, over the
   whole batch. ``throughput/microbatches`` sums the ranks' micro-batches and
   ``throughput/positions_per_action_token`` their positions (idle passes not counted).

**Routing replay** (``routing_replay``) runs as in the single-process learner: each micro-batch's
policy forward routes its tokens to the experts the engine recorded (an idle pass routes its two
padding tokens to expert 0, which changes nothing: its loss is 0).

**Publication** (:meth:`ShardedLearner.publish`): every parameter that ``save_pretrained`` would
write is gathered in full (``DTensor.full_tensor``, a collective) in state-dict order; rank 0 packs
them into buckets of at most ``trainer.publish_bucket_mb``, converts each bucket to Hugging Face
checkpoint names (:func:`saorl.models.hf_format.to_checkpoint`) and hands it to
``WeightSync.publish_checkpoint`` before the next is gathered.

**Checkpoints** (``trainer.shard_checkpoint``): ``sharded`` — each rank writes its shards with
``torch.distributed.checkpoint`` into the checkpoint's directory (``shards/``); ``full`` — the state
dicts are gathered to rank 0 and written in the single-process layout, from which a
single-process run can resume too. :meth:`load_state` reads either, and the single-process layout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from saorl.algo.advantages import RunningMeanBaseline
from saorl.algo.diagnostics import advantage_spread, first_action_advantages, mismatch_metrics
from saorl.algo.gae import value_targets
from saorl.algo.losses import lm_loss, masked_mean, ratio_histogram, value_loss
from saorl.algo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageInputs, AlgoPreset
from saorl.data.batch import collate
from saorl.data.packing import MicroBatch, idle_microbatch, microbatches
from saorl.data.trajectory import Trajectory
from saorl.models.critic import Critic
from saorl.models.hf_format import served_names, to_checkpoint
from saorl.models.loading import checkpoint_activations
from saorl.runtime import shard_group as sg
from saorl.runtime.checkpoint import SHARDS, load_learner_files, save_learner_files
from saorl.runtime.learner import Learner, OptimConfig
from saorl.runtime.nonfinite import params_finite, roll_back, snapshot
from saorl.runtime.weights import WeightSync


class GlobalBaseline(RunningMeanBaseline):
    """A running-mean baseline updated with the scores of every rank's share (module docstring)."""

    def __init__(self, momentum: float, group: sg.ShardGroup) -> None:
        super().__init__(momentum)
        self.group = group

    def update(self, scores: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(scores.detach().cpu())
        adv = super().update(torch.cat(parts))
        start = sum(len(p) for p in parts[: self.group.rank])
        return adv[start: start + len(scores)].to(scores.device)


def split_groups(gids: list[int], lengths: list[int], world: int) -> list[list[int]]:
    """Indices of each rank's share: whole groups (equal consecutive ``gids``), longest first to
    the rank with the fewest tokens so far; each share in batch order."""
    groups: list[list[int]] = []
    for i, g in enumerate(gids):
        if groups and gids[groups[-1][0]] == g:
            groups[-1].append(i)
        else:
            groups.append([i])
    load, shares = [0] * world, [[] for _ in range(world)]
    for members in sorted(groups, key=lambda m: -sum(lengths[i] for i in m)):
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r] += members
        load[r] += sum(lengths[i] for i in members)
    return [sorted(s) for s in shares]


def _dummy(pad_id: int) -> Trajectory:
    """Two prompt tokens, no action: the batch of a rank with no share (its passes are all idle)."""
    return Trajectory(token_ids=[pad_id, pad_id], action_mask=[0, 0], rollout_logprobs=[0.0, 0.0],
                      rewards=[0.0, 0.0], versions=[-1, -1], prompt_len=2)


def _rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` at ``mask``'s positions, on the CPU, detached (a rank's tokens for the metrics)."""
    return x.detach()[mask.bool()].float().cpu()


class ShardedLearner(Learner):
    """A :class:`~saorl.runtime.learner.Learner` whose models are FSDP2-sharded (module docstring).

    Rank 0 passes its real ``policy`` / ``critic`` and ``pad_id``; the other ranks pass None and
    get skeletons of rank 0's architecture, filled with rank 0's weights after sharding.
    """

    def __init__(self, policy, critic: Critic | None, preset: AlgoPreset, optim: OptimConfig, *,
                 group: sg.ShardGroup, pad_id: int | None, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, bucket_mb: float = 512.0, checkpoint_format: str = "sharded",
                 activation_checkpointing: bool = False, max_tokens_per_microbatch: int = 4096,
                 packing: bool = True) -> None:
        self.group, self.checkpoint_format = group, checkpoint_format
        self.bucket_bytes = int(bucket_mb * 2**20)
        desc = group.broadcast(sg.describe(policy, critic, pad_id) if group.rank == 0 else None)
        if group.rank != 0:
            policy, critic = sg.skeleton(desc)
        self._classes = desc
        full_policy = dict(policy.state_dict()) if group.rank == 0 else {}
        full_critic = dict(critic.state_dict()) if group.rank == 0 and critic is not None else {}
        self._names_model, _ = sg.skeleton({**desc, "critic": None})  # names and conversions only
        if group.rank == 0 and hasattr(policy, "_weight_conversions"):  # as loaded: as saved
            self._names_model._weight_conversions = policy._weight_conversions
        self._published = served_names(self._names_model)
        if activation_checkpointing:
            checkpoint_activations(policy, critic.trunk if critic is not None else None)
        sg.shard(policy, group.mesh)
        sg.fill_from_rank0(policy, full_policy, group)
        if critic is not None:
            sg.shard(critic, group.mesh)
            sg.fill_from_rank0(critic, full_critic, group)
        del full_policy, full_critic
        super().__init__(policy, critic, preset, optim, pad_id=desc["pad_id"], temperature=temperature,
                         top_k=top_k, top_p=top_p, device=str(group.device),
                         max_tokens_per_microbatch=max_tokens_per_microbatch, packing=packing)
        self.baseline = GlobalBaseline(preset.baseline_momentum, group)

    # ------------------------------------------------------------ rank 0 calls
    def _run(self, name: str, *args: Any) -> Any:
        if self.group.rank == 0:
            self.group.command(name, *args)
        return getattr(self, f"_all_{name}")(*args)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it closes the learner."""
        while True:
            name, args = self.group.receive()
            if name == "close":
                return
            if name == "publish":
                self._all_publish(None)
            else:
                getattr(self, f"_all_{name}")(*args)

    def close(self) -> None:
        """Rank 0: release the other ranks (their ``follow`` returns)."""
        if self.group.rank == 0:
            self.group.command("close")

    def step(self, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> dict[str, float]:
        if not trajectories:
            raise ValueError("Learner.step needs at least one trajectory")
        gids = list(group_ids if group_ids is not None else range(len(trajectories)))
        shares = split_groups(gids, [len(t) for t in trajectories], self.group.world)
        parts = [([trajectories[i] for i in s], [gids[i] for i in s]) for s in shares]
        return self._run("step", parts)

    def publish(self, sync: WeightSync) -> None:
        if self.group.rank == 0:
            self.group.command("publish")
        self._all_publish(sync)

    def full_models(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        return self._run("full_models")

    def save_state(self, directory: Path) -> dict:
        return self._run("save_state", Path(directory), self.checkpoint_format)

    def load_state(self, directory: Path, manifest: dict) -> None:
        self._run("load_state", Path(directory), manifest)

    # ------------------------------------------------------------- every rank
    def _token_total(self, mask: torch.Tensor) -> torch.Tensor:
        """The global count of ``mask`` (every rank's share; 0 counts as 1) over the world size:
        FSDP2 averages the ranks' gradients, so weighting by it gives the global mean's sum."""
        total = self.group.all_sum([float(mask.sum())])[0]
        return torch.tensor(max(total, 1.0) / self.group.world, device=mask.device)

    def _backward(self, loss: torch.Tensor) -> None:
        """Every rank runs every backward (FSDP's reduce-scatter), even of a non-finite loss: the
        step is then skipped on every rank."""
        loss.backward()

    def _optimizer_step(self, params, optimizer, loss: torch.Tensor) -> float | None:
        """``_finite_step`` of the single-process learner on the accumulated gradients, decided
        the same way on every rank."""
        if self.group.all_sum([0.0 if torch.isfinite(loss) else 1.0])[0]:
            optimizer.zero_grad(set_to_none=True)
            return None
        clip = self.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # global, the same everywhere
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return None
        saved = snapshot(params, optimizer)  # of this rank's shards
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not self.group.all_sum([0.0 if params_finite(params) else 1.0])[0]:
            return norm
        roll_back(params, optimizer, saved)  # on every rank, even where its own shards are finite
        return None

    def _with_idle(self, micro: list[MicroBatch]) -> list[MicroBatch]:
        """``micro`` and as many idle passes as make every rank's count the largest (docstring)."""
        most = max(self.group.all_gather(len(micro)))
        return micro + [idle_microbatch(self.pad_id, self.device, self.packing)] * (most - len(micro))

    def _critic_updates_sharded(self, batch, micro: list[MicroBatch], metrics: dict) -> torch.Tensor:
        p = self.preset
        needs_old = bool(p.value_clip) or p.lam_critic != 1.0
        old_values = self._values(batch, micro) if needs_old else None
        targets, mask = value_targets(batch.rewards, old_values, batch.action_mask, batch.response_mask,
                                      gamma=p.gamma, lam=p.lam_critic, skip_observation=p.skip_observation)
        self.critic.train()
        before = None
        for _ in range(p.critic_updates):
            values, _ = self._critic_pass(batch, micro, targets, mask, old_values)
            if before is None:
                old = _rows(old_values, mask) if old_values is not None else None
                before = (_rows(values, mask), _rows(targets, mask), old)
        self.critic.eval()
        after = self._values(batch, micro)
        tokens = self.group.gather((*before, _rows(after, mask)))
        if tokens is not None:
            metrics |= _critic_metrics(tokens, p.value_clip)
        return after

    def _all_step(self, parts: list[tuple[list[Trajectory], list[int]]]) -> dict[str, float] | None:
        p = self.preset
        trajs, gids = parts[self.group.rank]
        dummy = not trajs
        with self.timings.span("collate"):
            batch = collate(trajs or [_dummy(self.pad_id)], self.pad_id).to(self.device)
            micro = [] if dummy else microbatches(batch, self.max_tokens, self.packing)
        passes = self._with_idle(micro)
        self._apply_warmup()
        self.steps_done += 1
        metrics: dict[str, float] = {"policy/lr": self.policy_opt.param_groups[0]["lr"]}
        values = self._critic_updates_sharded(batch, passes, metrics) if p.use_critic else None
        with self.timings.span("advantages"):
            if dummy:
                if p.advantage == "running_mean":
                    self.baseline.update(torch.zeros(0))  # its part of the all-gather
                advantages = torch.zeros_like(batch.action_mask)
            else:
                advantages, _ = ADVANTAGE_ESTIMATORS[p.advantage](AdvantageInputs(
                    rewards=batch.rewards, action_mask=batch.action_mask, gamma=p.gamma, lam=p.lam_policy,
                    lam_alpha=p.vapo_alpha, values=values, response_mask=batch.response_mask,
                    skip_observation=p.skip_observation, group_ids=torch.tensor(gids, device=self.device),
                    baseline=self.baseline))
        advantages = advantages * batch.action_mask
        positive = torch.tensor([float(t.episode.success) for t in trajs] or [0.0], device=self.device)
        pos_tokens = positive[:, None] * batch.action_mask
        g_act, g_positions, g_micro = self.group.all_sum(
            [float(batch.action_mask.sum()), float(sum(mb.positions for mb in micro)), float(len(micro))])
        logprobs, entropy, total = self._policy_passes(batch, passes, advantages,
                                                       pos_tokens if p.lm_loss_coef else None)
        act = batch.action_mask
        tokens = (_rows(logprobs, act), _rows(batch.rollout_logprobs, act), _rows(advantages, act),
                  _rows(entropy, act), _rows(pos_tokens, act), _rows(self.version - batch.versions, act),
                  *first_action_advantages(advantages, batch.rewards, act))
        norm = self._policy_step(total)
        tokens = self.group.gather(tokens)
        if tokens is None:
            return None
        metrics |= _policy_metrics(p, tokens)
        metrics["throughput/positions_per_action_token"] = g_positions / max(g_act, 1.0)
        metrics["throughput/microbatches"] = int(g_micro)
        if p.advantage == "running_mean":
            metrics["advantage/baseline"] = float(self.baseline.value)
        if norm is not None:
            metrics["policy/grad_norm"] = norm
        metrics["policy/version"] = self.version
        metrics["train/nonfinite_skips"] = self.nonfinite_skips
        return metrics

    # --------------------------------------------------------- weights, state
    def _all_publish(self, sync: WeightSync | None) -> None:
        if sync is None:
            for _ in self._gathered_buckets():
                pass
            return
        buckets = (to_checkpoint(self._names_model, b) for b in self._gathered_buckets())
        sync.publish_checkpoint(buckets, self.version, self.policy.config)

    def _gathered_buckets(self):
        """Full tensors of the published names, gathered one by one on every rank; on rank 0
        yielded in buckets of at most ``bucket_bytes`` (a bigger tensor alone)."""
        state = self.policy.state_dict()
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name in self._published:
            t = state[name]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if self.group.rank != 0:
                continue
            nbytes = full.numel() * full.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            bucket[name] = full.detach().to("cpu")
            size += nbytes
        if bucket:
            yield bucket

    def _all_full_models(self):
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        policy = get_model_state_dict(self.policy, options=full)
        critic = get_model_state_dict(self.critic, options=full) if self.critic is not None else None
        if self.group.rank != 0:
            return None
        cls, config = self._classes["policy"]
        out_policy = sg.replica(cls, config, policy, like=self.policy)
        out_critic = None
        if critic is not None:
            trunk_cls, trunk_config, _ = self._classes["critic"]
            out_critic = sg.replica(Critic, (trunk_cls, trunk_config), critic, like=self.critic)
        return out_policy, out_critic

    def _models(self) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
        out = [("policy", self.policy, self.policy_opt)]
        return out + ([("critic", self.critic, self.critic_opt)] if self.critic is not None else [])

    def _all_save_state(self, directory: Path, fmt: str) -> dict | None:
        if fmt == "sharded":
            state = {}
            for name, model, opt in self._models():
                state[name] = get_model_state_dict(model)
                state[f"{name}_optim"] = get_optimizer_state_dict(model, opt)
            dcp.save(state, checkpoint_id=str(directory / SHARDS), process_group=self.group.control)
            return {"shard_checkpoint": "sharded"}
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        dicts: dict[str, Any] = {}
        for name, model, opt in self._models():  # gathered on rank 0 only
            dicts[name] = get_model_state_dict(model, options=full)
            dicts[f"{name}_optim"] = get_optimizer_state_dict(model, opt, options=full)
        if self.group.rank != 0:
            return None
        for name, model, _ in self._models():
            dicts[f"{name}_optim"] = _by_index(dicts[f"{name}_optim"], model)
        return save_learner_files(directory, dicts["policy"], dicts["policy_optim"], dicts.get("critic"),
                                  dicts.get("critic_optim")) | {"shard_checkpoint": "full"}

    def _all_load_state(self, directory: Path, manifest: dict) -> None:
        if (directory / SHARDS).is_dir():
            state = {}
            for name, model, opt in self._models():
                state[name] = get_model_state_dict(model)
                state[f"{name}_optim"] = get_optimizer_state_dict(model, opt)
            dcp.load(state, checkpoint_id=str(directory / SHARDS), process_group=self.group.control)
            for name, model, opt in self._models():
                set_model_state_dict(model, state[name])
                set_optimizer_state_dict(model, opt, state[f"{name}_optim"])
        else:
            files = load_learner_files(directory, manifest) if self.group.rank == 0 else (None,) * 4
            full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            for (model_sd, optim_sd), (_, model, opt) in zip(zip(files[::2], files[1::2]), self._models()):
                set_model_state_dict(model, model_sd or {}, options=full)
                optim_sd = _by_name(optim_sd, model) if optim_sd else {}
                set_optimizer_state_dict(model, opt, optim_sd, options=full)
        self.version, self.steps_done = int(manifest["version"]), int(manifest["learner_steps"])
        self.nonfinite_skips = int(manifest["nonfinite_skips"])
        self.baseline.load_state_dict(manifest["baseline"])


# ------------------------------------------------------------------ optimizer state layouts
def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the optimizer's parameters, in its order (``Learner`` takes them in this order)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _by_index(state: dict, model: torch.nn.Module) -> dict:
    """A full optimizer state dict keyed by parameter name → torch's layout (by index)."""
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def _by_name(state: dict, model: torch.nn.Module) -> dict:
    """Torch's optimizer layout (by index) → keyed by parameter name (what set_optimizer_state_dict reads)."""
    names = _trainable_names(model)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}


# ---------------------------------------------------------------------------------- metrics
def _cat(tokens: list[tuple], i: int) -> torch.Tensor:
    """Column ``i`` of every rank's gathered tokens, as ``[N, 1]`` rows of one token each."""
    return torch.cat([t[i] for t in tokens])[:, None]


def _critic_metrics(tokens: list[tuple], value_clip: float | None) -> dict[str, float]:
    """The single-process learner's critic metrics, from every rank's value-target tokens."""
    v0, r, after = _cat(tokens, 0), _cat(tokens, 1), _cat(tokens, 3)
    ones = torch.ones_like(r)
    clip = {"old_values": _cat(tokens, 2), "clip": value_clip} if value_clip else {}
    _, before = value_loss(v0, r, ones, **clip)
    _, post = value_loss(after, r, ones)
    return {
        "critic/value_loss": before["critic/value_loss"],
        "critic/value_loss_after": post["critic/value_loss"],
        "critic/explained_var": before["critic/explained_var"],
        "critic/explained_var_after": post["critic/explained_var"],
        "critic/value_mean": post["critic/value_mean"],
        "critic/return_mean": float(masked_mean(r, ones)),
    }


def _policy_metrics(p: AlgoPreset, tokens: list[tuple]) -> dict[str, float]:
    """The single-process learner's policy metrics (and its loss value), from every rank's action
    tokens: the same functions over the whole batch's tokens, one token per row."""
    logprobs, rollout, adv, entropy, pos, staleness = (_cat(tokens, i) for i in range(6))
    ones = torch.ones_like(logprobs)
    behaviour = rollout if p.behaviour == "rollout" else logprobs
    loss, metrics = POLICY_LOSSES[p.policy_loss](logprobs, behaviour, adv, ones, p.eps_low, p.eps_high)
    metrics |= mismatch_metrics(logprobs, rollout, ones, staleness.long(), p.eps_low, p.eps_high,
                                advantages=adv)
    adv_mean = masked_mean(adv, ones)
    metrics["advantage/mean"] = float(adv_mean)
    metrics["advantage/std"] = float(masked_mean((adv - adv_mean) ** 2, ones).sqrt())
    metrics["policy/ratio_hist"] = ratio_histogram(torch.exp(logprobs - rollout), ones)[0].tolist()
    first_adv, returns = _cat(tokens, 6), _cat(tokens, 7)  # one row per trajectory with actions
    metrics |= advantage_spread(first_adv, returns, torch.ones_like(returns))
    mean_entropy = masked_mean(entropy, ones)
    if p.entropy_coef:
        loss = loss - p.entropy_coef * mean_entropy
    if p.lm_loss_coef:
        lm = lm_loss(logprobs, ones, pos[:, 0])
        loss = loss + p.lm_loss_coef * lm
        metrics["policy/lm_loss"] = float(lm)
    metrics["policy/loss"] = float(loss) if torch.isfinite(loss) else math.nan
    metrics["policy/entropy"] = float(mean_entropy)
    return metrics
