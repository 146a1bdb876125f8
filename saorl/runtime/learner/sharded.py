"""The sharded learner: policy and critic under torch FSDP2 over the ranks of a ``torchrun`` launch.

``torchrun --standalone --nproc-per-node N -m saorl.cli train CONFIG trainer.shard=fsdp2``: every
rank runs ``saorl train``. Rank 0 does all a single-process run does (stages, feed, journal,
evaluation, checkpoints) with a :class:`ShardedLearner` as its learner; the other ranks build the
same learner on skeleton models (:mod:`saorl.runtime.learner.shard_group`) and serve it
(:meth:`ShardedLearner.follow`) until rank 0 closes it.

**Commands.** Whatever needs the other ranks — a step, a publication, the full models, a
checkpoint save or load, the end — starts on rank 0 by broadcasting ``(name, args)`` on the
control channel; every rank then runs the same ``_all_<name>`` method, so the collectives inside
run in the same order everywhere.

**The step** is the single-process :meth:`~saorl.runtime.learner.single.Learner.step` itself, run by
every rank on its share with a :class:`~saorl.runtime.learner.shard_update.ShardedUpdater`, which holds
all that crosses ranks (the share split, the idle passes, the global counts, the backward, the
optimizer step and the gather of the step's record); this class adds the commands, the baseline
over every rank's scores, publication and checkpoints.
It equals a single-process step on the same batch, up to float rounding:

1. rank 0 hands each rank its share: whole groups (GRPO's groups never split), greedily balanced
   by tokens.
2. Each rank cuts its share into token-budget micro-batches (``trainer.max_tokens_per_microbatch``,
   ``trainer.packing``) and runs every model pass on them with gradient accumulation — the very
   code of the single-process learner (its "Micro-batches": ``_values``, ``_critic_pass``,
   ``_policy_scores``, ``_policy_update``), so a long batch fits in memory on every rank. Every loss
   is a token mean over the whole batch: a micro-batch's loss is weighted by its tokens over the
   **global** count (all-reduced once per loss), times the world size, because FSDP2 averages
   gradients over the ranks (:meth:`ShardedUpdater.token_total`); so the ranks' accumulated
   gradients add up to the global mean's.
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
   rank: every rank rolls its shards back (:mod:`saorl.runtime.learner.nonfinite`).
4. The running-mean baseline sees the scores of the whole batch (all-gathered): every rank keeps
   an identical baseline and takes its own trajectories' advantages.
5. Metrics: each rank's :class:`~saorl.runtime.learner.step_record.StepRecord` (the per-token values on
   action and value-target tokens) is gathered to rank 0 as rows of one token each, where the
   single-process learner's metrics function runs over the whole batch. ``policy/loss`` is the
   ranks' summed loss, ``throughput/microbatches`` sums the ranks' micro-batches and
   ``throughput/positions_per_action_token`` their positions (idle passes not counted).

**Routing replay** (``routing_replay``) runs as in the single-process learner: each micro-batch's
policy forward routes its tokens to the experts the engine recorded (an idle pass routes its two
padding tokens to expert 0, which changes nothing: its loss is 0).

**Publication** (:meth:`ShardedLearner.publish`): every parameter that ``save_pretrained`` would
write is gathered in full (``DTensor.full_tensor``, a collective) in state-dict order; rank 0 packs
them into buckets of at most ``trainer.publish_bucket_mb``, converts each bucket to Hugging Face
checkpoint names (:func:`saorl.models.hf_format.to_checkpoint`) and hands it to
``WeightPublisher.publish`` before the next is gathered.

**Checkpoints** (``trainer.shard_checkpoint``): ``sharded`` — each rank writes its shards with
``torch.distributed.checkpoint`` into the checkpoint's directory (``shards/``); ``full`` — the state
dicts are gathered to rank 0 and written in the single-process layout, from which a
single-process run can resume too. :meth:`load_state` reads either, and the single-process layout.
"""

from __future__ import annotations

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
from saorl.algo.registry import AlgoPreset
from saorl.data.trajectory import Trajectory, training_rows
from saorl.models.critic import Critic
from saorl.models.hf_format import served_names, to_checkpoint
from saorl.models.loading import checkpoint_activations
from saorl.runtime.learner import shard_group as sg
from saorl.runtime.learner.shard_update import ShardedUpdater, split_groups
from saorl.runtime.learner.single import Learner, OptimConfig
from saorl.runtime.learner.state_files import SHARDS, load_learner_files, save_learner_files
from saorl.runtime.learner.step_record import StepResult
from saorl.runtime.weights.base import WeightNames, WeightPublisher


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


class ShardedLearner(Learner):
    """A :class:`~saorl.runtime.learner.single.Learner` whose models are FSDP2-sharded (module docstring).

    Rank 0 passes its real ``policy`` / ``critic`` and ``pad_id``; the other ranks pass None and
    get skeletons of rank 0's architecture, filled with rank 0's weights after sharding.
    """

    def __init__(self, policy, critic: Critic | None, preset: AlgoPreset, optim: OptimConfig, *,
                 group: sg.ShardGroup, pad_id: int | None, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, bucket_mb: float = 512.0, checkpoint_format: str = "sharded",
                 activation_checkpointing: bool = False, max_tokens_per_microbatch: int = 4096,
                 packing: bool = True, shared_prefix: bool = True) -> None:
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
                         max_tokens_per_microbatch=max_tokens_per_microbatch, packing=packing,
                         updater=ShardedUpdater(group), shared_prefix=shared_prefix)
        self.counters.baseline = GlobalBaseline(preset.baseline_momentum, group)

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

    def step(self, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> StepResult:
        if not trajectories:
            raise ValueError("Learner.step needs at least one trajectory")
        gids = list(group_ids if group_ids is not None else range(len(trajectories)))
        trajectories, gids = training_rows(trajectories, gids)  # an episode's segments: rows of their own
        shares = split_groups(gids, [len(t) for t in trajectories], self.group.world)
        parts = [([trajectories[i] for i in s], [gids[i] for i in s]) for s in shares]
        return self._run("step", parts, self.version)

    def publish(self, sync: WeightPublisher) -> None:
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
    def _all_step(self, parts: list[tuple[list[Trajectory], list[int]]], version: int) -> StepResult | None:
        # rank 0's version, which a resume may have moved past the checkpoint's (above the versions
        # published before a crash): every rank measures its share's staleness against it
        self.version = version
        return self._step_share(*parts[self.group.rank])

    # --------------------------------------------------------- weights, state
    def _all_publish(self, sync: WeightPublisher | None) -> None:
        if sync is None:
            for _ in self._gathered_buckets():
                pass
            return
        buckets = (to_checkpoint(self._names_model, b) for b in self._gathered_buckets())
        sync.publish(buckets, self.version, WeightNames.checkpoint(self.policy.config))

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
        self.counters.restore(manifest)


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
