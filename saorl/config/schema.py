"""The config sections of the algorithm, trainer, runtime and stages, and the root
:class:`SaorlConfig` with its cross-field checks (see :mod:`saorl.config`)."""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    create_model,
    field_validator,
    model_validator,
)

from saorl.config.engines import ENGINE_CONFIGS
from saorl.config.sections import (
    EnvConfig,
    FieldError,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    Section,
)
from saorl.config.sizing import fill_sized

if TYPE_CHECKING:
    from saorl.algo.presets import AlgoPreset


class _AlgoSection(Section):
    """The ``algo`` section: a preset name plus overrides; its other fields are derived from
    :class:`saorl.algo.presets.AlgoPreset` (see :func:`_algo_config`)."""

    name: str = "sao"
    """Algorithm preset: ``sao``, ``grpo``, ``grpo_dis``, ``vapo``, ``ppo`` or ``reinforce_rm``."""

    @field_validator("name")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        from saorl.algo.presets import list_presets

        names = list_presets()
        if v not in names:
            hint = difflib.get_close_matches(v, names, n=1)
            raise ValueError(f"unknown algorithm {v!r}" + (f" (did you mean {hint[0]}?)" if hint else "")
                             + f"; known: {', '.join(names)}")
        return v

    _preset: Any = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _one_lam_policy(cls, data: Any) -> Any:
        """The spellings of λ_policy that configs have (and saved runs kept) made the one typed
        value: ``adaptive`` is ``{adaptive: {alpha: α}}`` with α = ``vapo_alpha`` if given, else
        the preset's, else the paper's :data:`PAPER_VAPO_ALPHA`; ``vapo_alpha: α`` alone
        (:data:`LAM_POLICY_SPELLINGS`) is the rule with that α. A number beside a ``vapo_alpha`` is
        refused (one would be ignored)."""
        if not isinstance(data, dict) or not {"lam_policy", "vapo_alpha"} & set(data):
            return data
        from saorl.algo.presets import PRESETS, AdaptiveLambda

        data = dict(data)
        lam, alpha = data.get("lam_policy"), data.pop("vapo_alpha", None)
        if alpha is not None and not (lam is None or lam == "adaptive"):
            raise FieldError("lam_policy", f"is {lam!r} while algo.vapo_alpha is set too, and a fixed "
                             "λ_policy and the length-adaptive one exclude each other: drop algo.vapo_alpha "
                             "for a fixed λ, or write algo.lam_policy: adaptive")
        if isinstance(lam, str) and lam != "adaptive":
            raise FieldError("lam_policy", "must be a number in [0, 1], 'adaptive' or "
                             f"{{adaptive: {{alpha: α}}}}, got {lam!r}")
        if lam == "adaptive" and alpha is None:
            own = getattr(PRESETS.get(data.get("name", "sao")), "lam_policy", None)
            alpha = own.alpha if isinstance(own, AdaptiveLambda) else PAPER_VAPO_ALPHA
        if alpha is not None:
            data["lam_policy"] = {"adaptive": {"alpha": alpha}}
        return data

    @model_validator(mode="after")
    def _resolve(self) -> _AlgoSection:
        """The run's preset: ``name`` with the fields set here applied, resolved here once (again
        only on assignment to a field) and read as :attr:`preset`; the preset's own checks (ranges;
        e.g. grpo needs group_size >= 2) are reported under ``algo.<field>``."""
        from pydantic import ValidationError

        from saorl.algo.presets import get_preset

        fields = [k for k in type(self).model_fields if k != "name"]
        overrides = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        try:
            self._preset = get_preset(self.name).with_overrides(**overrides)
        except ValidationError as e:
            err = e.errors()[0]
            why = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
            raise FieldError(".".join(map(str, err["loc"])), f"algorithm {self.name!r}: {why}") from None
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> _AlgoSection:
        """A copy; with ``update``, validated and its preset resolved again (pydantic's copy would
        keep the preset of the fields before the update)."""
        out = super().model_copy(update=update, deep=deep)
        return type(self).model_validate(out.model_dump()) if update else out

    @property
    def preset(self) -> AlgoPreset:
        """The resolved preset (:class:`saorl.algo.presets.AlgoPreset`): the algorithm the run
        trains with, resolved once when this section was validated."""
        return self._preset


PAPER_VAPO_ALPHA = 1.5
"""α of the length-adaptive λ_policy = 1 − 1/(α·l) as the SAO paper runs it (docs/method.md,
"Fidelity to the paper"); ``algo.lam_policy: adaptive`` uses it when nothing else sets α."""

LAM_POLICY_SPELLINGS = ("vapo_alpha",)
"""Keys of the ``algo`` section that are no fields but older spellings of ``lam_policy`` (configs and
saved runs have them): ``vapo_alpha: α`` is ``lam_policy: {adaptive: {alpha: α}}``."""

NOT_IN_CONFIG = ("name", "mode")
"""Preset fields the ``algo`` section does not override: ``name`` picks the preset, and the
schedule is ``runtime.mode``."""


def _algo_config() -> type[_AlgoSection]:
    """``AlgoConfig``: every other preset field, optional (None = the preset's value), with the
    preset's own type, bounds and documentation. A setting is declared once, in the preset."""
    from saorl.algo.presets import setting_docs, setting_types

    docs = setting_docs()
    fields: dict[str, Any] = {}
    for name, hint in setting_types().items():
        if name in NOT_IN_CONFIG:
            continue
        more = ""
        if name == "lam_policy":  # the config's older spellings, made the typed value by ``_one_lam_policy``
            more = (" Also spelled ``adaptive``: the rule with the preset's α, else "
                     f"{PAPER_VAPO_ALPHA} (``vapo_alpha: α`` beside it, or alone, gives α); a number "
                     "switches a preset's adaptive rule off.")
        fields[name] = (hint | None, Field(None, description=f"{docs[name]}{more} None: the preset's value."))
    return create_model("AlgoConfig", __base__=_AlgoSection, __module__=__name__, **fields)


AlgoConfig = _algo_config()


class TrainerConfig(Section):
    batch_size: int = Field(4, ge=1)
    """Trajectories per policy update (a multiple of the preset's group size)."""
    steps: int = Field(200, ge=1)
    """Policy updates to run."""
    max_wall_s: float | None = Field(None, gt=0.0)
    """Stop (with a final checkpoint) after this many seconds; None = no limit."""
    stop_timeout_s: float = Field(120.0, gt=0.0)
    """The bound on a stop by Ctrl-C or SIGTERM. The first one finishes the current step (an
    evaluation in progress is dropped), writes a checkpoint and ``final/``, stops the workers and
    exits with status 0; if that is not done this many seconds after the signal, the run stops at
    once, as a second Ctrl-C or SIGTERM makes it do at any time: the step in progress is abandoned,
    nothing more is written, the last checkpoint written before is intact (``saorl train --resume``
    continues from it) and the exit status is 130."""
    policy_lr: float | None = Field(None, gt=0.0)
    """AdamW learning rate of the policy; null: 3e-5 for a small model (the tiny built-ins: 1e-4
    tipped the Quick start's policy in 4 of 9 runs, docs/guide.md), 1e-5 for a pretrained one
    (:mod:`saorl.config.sizing`; 1e-4 broke SmolLM2-135M within 5 steps)."""
    critic_lr: float | None = Field(None, gt=0.0)
    """AdamW learning rate of the critic; null: ``critic_lr_ratio × policy_lr`` when that ratio
    is set, else 1e-3 for a small model, 5e-5 for a pretrained one."""
    critic_lr_ratio: float | None = Field(None, gt=0.0)
    """The critic's learning rate as a multiple of the policy's (the SAO paper: 5, critic 5e-6 for
    policy 1e-6); null: ``critic_lr`` as it is. Setting both is refused."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (policy and critic)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value (policy and critic separately)."""
    max_staleness: int | None = Field(None, ge=0)
    """Drop trajectories whose oldest action token is more than this many versions old (counted
    in the metrics); None = no limit."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many steps (0 = none); the policy's counts from its
    first update, after ``critic_warmup_steps``."""
    critic_warmup_steps: int = Field(0, ge=0)
    """The first this many trainer steps train the critic alone (algorithms with a critic): each
    takes a batch of trajectories as any step does (journalled, trained, checkpointed; a resume
    continues the count), makes the critic's K updates on it, and leaves the policy as it is (its
    version does not advance, nothing new is published; its log-probs are still computed for the
    metrics, ``critic/warmup`` is 1). The SAO paper warms the critic up for 10 steps at the start
    of RL. ``critic_warmup`` says how those steps warm it up."""
    critic_warmup: Literal["steps", "lr"] = "steps"
    """How the critic is warmed up over ``critic_warmup_steps``. ``steps``: critic-only steps,
    the policy frozen (above). ``lr``: the policy trains from step 1 and the critic's learning
    rate ramps linearly, ``critic_lr × min(1, k / critic_warmup_steps)`` at trainer step k (times
    the ``warmup_steps`` ramp, when that is set; ``critic/lr`` logs it). Two readings of the
    paper's "critic warm-up"; ``lr`` needs ``critic_warmup_steps`` > 0."""
    staleness_lr_ref: float | None = Field(None, gt=0.0)
    """A staleness-aware learning rate: each step's policy learning rate is ``policy_lr`` times
    ``min(1, staleness_lr_ref / s)``, ``s`` the batch's mean staleness over its action tokens
    (versions between each token's sampler and the trainer). At staleness up to the reference
    the rate is unchanged; beyond it ``policy_lr × s`` stays at ``policy_lr × staleness_lr_ref``
    (docs/method.md, "How far the policy may move"). None = off."""
    shard: Literal["none", "fsdp2"] = "none"
    """``none``: policy and critic train in one process. ``fsdp2``: torch FSDP2 shards them over
    the ranks of a ``torchrun`` launch (``torchrun --standalone --nproc-per-node N -m saorl.cli
    train ...``; gloo on CPU, NCCL on CUDA); rank 0 runs the rollout feed, journal and
    checkpoints and hands every rank its share of each batch (docs/scaling.md)."""
    shard_checkpoint: Literal["sharded", "full"] = "sharded"
    """With ``shard: fsdp2``: ``sharded`` writes each rank's shards with
    ``torch.distributed.checkpoint`` (no rank ever holds the whole model); ``full`` gathers the
    weights and optimizer states to rank 0 and writes the single-process layout. Resume reads
    either, and a single-process run resumes from a ``full`` one."""
    publish_bucket_mb: float = Field(512.0, gt=0.0)
    """With ``shard: fsdp2``: published weights are gathered and written in buckets of at most
    this many MiB (a tensor larger than that is a bucket of its own), so rank 0 never holds more
    than one bucket of the full model at a time."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (less memory for long sequences, about a third more compute); policy and critic, in RL, in
    the SFT warm start and in value pretraining (not yet in those two stages with ``shard: fsdp2``)."""
    max_tokens_per_microbatch: int = Field(4096, ge=1)
    """Token budget of one forward/backward pass of the policy or the critic: a batch is cut into
    micro-batches of at most this many positions (with ``shard: fsdp2``, each rank's share of
    it) and gradients accumulate across them; losses are still normalised by the whole batch's
    token counts. A trajectory longer than the budget gets a micro-batch of its own (nothing is
    truncated)."""
    packing: bool = True
    """Pack the trajectories of a micro-batch end to end in one row with no padding (sequence
    boundaries through per-sequence position ids; every HF causal LM with sdpa, eager or
    flash-attention honours them). False: right-padded micro-batches of similar lengths, for a
    model whose attention ignores restarting position ids."""
    shared_prefix: bool = True
    """With packing: a packed row holds the opening tokens every trajectory of the batch shares (a
    tools system message, a few-shot preamble) once, each trajectory continuing from it (exact:
    the same log-probs, values and gradients from fewer positions). Policy, critic, SFT and value
    pretraining; used only where the model's attention is ``sdpa`` (switched to saorl's
    ``sdpa_varlen``) with no sliding-window layer, and never with ``algo.routing_replay``."""
    max_nonfinite_skips: int = Field(3, ge=1)
    """Stop the run (non-zero exit, after a checkpoint of the last finite weights) when this many
    trainer steps in a row had an update skipped because its loss, gradient or updated
    parameters would not be finite."""


class RuntimeConfig(Section):
    backend: Literal["local", "inprocess", "ray"] = "local"
    """``local``: rollout workers as processes on this machine; ``inprocess``: episodes on one engine
    in the trainer's own process (no worker processes; for debugging and small machines);
    ``ray``: rollout workers as Ray actors, on this machine or a cluster (the ``ray`` section;
    needs ``pip install -e ".[ray]"``)."""
    mode: Literal["auto", "async", "sync"] = "auto"
    """Rollout/training schedule; ``auto`` uses the algorithm preset's mode."""
    trainer_threads: int | None = Field(None, ge=1)
    """Torch threads of the trainer process; None = the machine's cores minus one per rollout
    worker (at least 1). Oversubscribing cores makes OpenMP spin and everything crawl."""
    worker_threads: int = Field(1, ge=1)
    """Torch threads of each rollout worker process."""
    worker_stall_s: float = Field(60.0, gt=0.0)
    """A local rollout worker that has made no progress — no token decoded, no call made, no CPU
    used — for this many seconds (stopped, deadlocked, stuck in a call that never returns) is
    killed and restarted like one that died, its rollouts re-queued (counted in the restart
    budget). The limit grows to 3 × the worker's longest measured stretch without progress, and
    is multiplied by the machine's load average per core when above 1, so a slow worker on a
    loaded machine is never taken for a stalled one (``saorl.runtime.backends.watchdog``)."""

    @field_validator("backend")
    @classmethod
    def _ray_installed(cls, v: str) -> str:
        import importlib.util

        if v == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("'ray' needs Ray installed: pip install -e \".[ray]\" (or pip install ray)")
        return v


class RayConfig(Section):
    """Where and how the Ray backend (``runtime.backend: ray``) places rollout workers."""

    address: str | None = None
    """Address of a running Ray cluster (``auto``, ``ray://host:10001``, ``host:6379``); None
    starts a private local cluster for the run and stops it at the end. Checked before the first
    stage: it must take a connection within 3 s and answer as a Ray cluster within 20 s, or the
    run does not start (exit status 2)."""
    num_cpus: float | None = Field(None, gt=0.0)
    """Logical CPUs of the private local cluster (None: the machine's cores); ignored with
    ``address``."""
    num_gpus: int | None = Field(None, ge=0)
    """GPUs of the private local cluster (None: those Ray detects); ignored with ``address``."""
    temp_dir: str | None = None
    """Session directory of the private local cluster; None makes a short one,
    ``/tmp/saorl-ray-*`` (Ray's Unix socket paths must stay under 107 bytes), which is removed at
    shutdown (after ``kill -9`` of the trainer or of its whole process group: by the watchdog, a
    process of its own session; were that killed too, when the next private cluster starts).
    A directory given here is left in place."""
    worker_cpus: float = Field(1.0, gt=0.0)
    """CPUs reserved for each rollout worker actor (fractions allowed)."""
    worker_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved for each rollout worker actor (its engine runs on ``cuda`` when > 0)."""
    trainer_cpus: float = Field(1.0, ge=0.0)
    """CPUs reserved for the trainer (this process) on its own node, so no worker takes them."""
    trainer_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved for the trainer on its own node (the ranks of a sharded trainer use them)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the workers' bundles (one bundle per worker)."""
    max_restarts: int = Field(5, ge=0)
    """Worker actors Ray may restart after they die, over the whole run; one more death stops the
    run with an error (a worker that keeps dying is a bug to see, not to hide)."""
    weights: Literal["shared_fs", "object_store"] = "shared_fs"
    """How published weights reach the workers: ``shared_fs`` through files in the run directory
    (every node must see it at the same path); ``object_store`` through Ray's object store (no
    shared filesystem needed; the model directory must still exist on every node)."""
    ready_timeout_s: float = Field(600.0, gt=0.0)
    """Seconds to wait for the cluster to grant the placement group before failing (exit status
    3). Resources the cluster does not have at all are refused before the first stage (exit status
    2); this wait is for resources that other jobs hold."""


class SFTConfig(Section):
    enabled: bool = True
    """Before RL, fine-tune the initial policy on the env's demonstrations (loss on action tokens
    only): the "SFT model" RL starts from. Cached under ``run.out_dir/.cache``, so runs with the
    same policy, env, seed and SFT settings share one."""
    steps: int | None = Field(None, ge=1)
    """Optimizer steps of supervised fine-tuning; null: 1000 for a small model (the tiny
    built-ins), 40 for a pretrained one (:mod:`saorl.config.sizing`)."""
    batch_size: int | None = Field(None, ge=1)
    """Demonstrations per SFT step; null: 32 for a small model, 8 for a pretrained one."""
    lr: float | None = Field(None, gt=0.0)
    """Peak AdamW learning rate (linear warm-up, cosine decay); null: 3e-3 for a small model,
    5e-5 for a pretrained one."""
    num_demos: int | None = Field(None, ge=1)
    """Demonstrations generated from training tasks (the env's ``demo_error_rate`` option says
    how many of them are deliberately wrong); null: 2000 for a small model, 320 for a pretrained
    one."""
    seed: int | None = None
    """Seed of the demonstrations and of SFT; null = the run's ``seed``. Fix it to start runs of
    different seeds from one SFT model (as the experiments do)."""


class ValuePretrainConfig(Section):
    enabled: bool = True
    """Before RL, fit the critic on Monte-Carlo returns of rollouts of the initial policy, when the
    algorithm preset asks for it (``algo.value_pretrain``). Cached under ``run.out_dir/.cache``."""
    rollouts: int | None = Field(None, ge=2)
    """Rollouts of the initial policy sampled (one per training task); 20% are held out for the
    validation loss and explained variance (512: ~100 held out; measured on math_tool, 128 left 26,
    too few for the explained variance to mean anything); null: 512 for a small model (the tiny
    built-ins), 32 for a pretrained one (:mod:`saorl.config.sizing`: minutes, not hours, on a CPU)."""
    steps: int | None = Field(None, ge=1)
    """Critic optimizer steps of each fit (one fit per data fraction: 25%, 50%, 100%); null: 100
    for a small model, 8 for a pretrained one."""
    curve: bool | None = None
    """Fit on 25% and 50% of the rollouts too, each fit from the same initial critic, for the
    scaling curve (how much the critic gains from more rollouts); false: the 100% fit only, a
    third of the fitting time (the critic kept is the same either way; a real model's fits take
    minutes each on a CPU); null: true for a small model, false for a pretrained one."""
    batch_size: int | None = Field(None, ge=1)
    """Rollouts per critic step; null: 16 for a small model, 8 for a pretrained one."""
    lr: float | None = Field(None, gt=0.0)
    """AdamW learning rate of the critic during value pretraining; null: 1e-3 for a small model,
    5e-5 for a pretrained one."""


class SaorlConfig(Section):
    """Everything a run needs. Defaults = ``configs/sao_math_tool.yaml``, SAO on math_tool, CPU."""

    seed: int = 0
    """Seed for task generation, sampling and initialisation."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Run directory, evaluation, checkpoint and logging cadence."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy, critic and tokenizer."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environment and task source."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout workers, inference engine and sampling."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """Algorithm preset and overrides of its defaults."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimisation: batch, steps, learning rates, staleness limit."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Orchestration backend and schedule."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray cluster and the workers' resources (used with ``runtime.backend: ray``)."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Supervised warm start of the policy before RL."""
    value_pretrain: ValuePretrainConfig = Field(default_factory=ValuePretrainConfig)
    """Value pretraining of the critic on rollouts of the initial policy, before RL."""

    @model_validator(mode="after")
    def _cross_checks(self) -> SaorlConfig:
        fill_sized(self)  # the learning rates and stage sizes left null, by the policy's size
        if self.run.name is None:  # what the run is: <algo>-<env>
            env = self.env.type.rpartition(":")[2].rpartition(".")[2]
            self.run.name = f"{self.algo.name}-{env}"
        group = self.algo.preset.group_size
        if self.trainer.batch_size % group:
            raise FieldError(
                "trainer.batch_size",
                f"{self.trainer.batch_size} is not a multiple of the group size "
                f"({group}, algo {self.algo.name!r}): every update takes whole groups; set "
                f"trainer.batch_size to a multiple of {group} (e.g. trainer.batch_size={group})"
            )
        if self.trainer.critic_warmup_steps and not self.algo.preset.use_critic:
            raise FieldError("trainer.critic_warmup_steps",
                             f"algo {self.algo.name!r} trains no critic, so there is nothing to warm "
                             "up; set trainer.critic_warmup_steps=0, or pick an algorithm with a critic "
                             "(sao, vapo)")
        top = self.algo.preset.critic_train_layers
        if top is not None and self.model.lora.critic:
            raise FieldError("algo.critic_train_layers",
                             f"is {top}, but model.lora.critic puts a LoRA adapter in every layer of the "
                             "critic; train the top layers or the adapter: drop one of the two")
        if top is not None and self.trainer.shard == "fsdp2":
            raise FieldError("algo.critic_train_layers",
                             f"is {top}, but the sharded trainer (trainer.shard: fsdp2) does not run a "
                             "critic in parts yet; set trainer.shard=none or drop algo.critic_train_layers")
        if self.trainer.critic_warmup == "lr" and not self.trainer.critic_warmup_steps:
            raise FieldError("trainer.critic_warmup",
                             "'lr' ramps the critic's learning rate over trainer.critic_warmup_steps, "
                             "which is 0; set trainer.critic_warmup_steps to the ramp's length (e.g. 10)")
        if self.env.type == "openai_agent" and self.algo.preset.advantage == "grpo":
            raise FieldError(
                "algo.name",
                f"algo {self.algo.name!r} baselines each rollout against its group (advantage=grpo), and "
                "an openai_agent episode that rewrote its history trains as one row per segment, each "
                "with the episode's reward, so the group's mean and std would count that episode once "
                "per segment; group statistics per episode are not implemented yet. Pick an algorithm "
                "with a critic (sao, vapo, ppo) or reinforce_rm for env.type=openai_agent")
        if self.trainer.shard == "fsdp2" and self.model.device == "mps":
            raise FieldError("trainer.shard", "fsdp2 shards over gloo (model.device=cpu) or NCCL "
                                               "(model.device=cuda), not mps; set trainer.shard=none")
        if (self.runtime.backend == "ray" and self.ray.weights == "object_store"
                and self.rollout.engine.IN_PLACE):
            raise FieldError("ray.weights", f"object_store hands the weights to saorl's own engines; the "
                                            f"{self.rollout.engine.kind} servers load each version from "
                                            "RUN/weights/hf and are checked there: set ray.weights=shared_fs")
        if self.model.lora.enabled:
            self._lora_checks()
        # routing_replay: every engine returns routes (local: recorded; http / sglang / vllm: asked
        # of the servers, which must run with --enable-return-routed-experts) and both trainers,
        # sharded or not, replay them
        return self

    def _lora_checks(self) -> None:
        """What LoRA (``model.lora.rank``) does not reach yet, refused before anything runs."""
        if self.trainer.shard == "fsdp2":
            raise FieldError("model.lora.rank", "LoRA trains in one trainer process only: the sharded "
                             "trainer (trainer.shard=fsdp2) does not shard or publish adapters yet; set "
                             "trainer.shard=none, or model.lora.rank=null to train the whole policy sharded")
        kind = self.rollout.engine.kind
        if not self.rollout.engine.LOADS_ADAPTERS:
            able = ", ".join(k for k, c in ENGINE_CONFIGS.items() if c.LOADS_ADAPTERS)
            raise FieldError("model.lora.rank", f"LoRA adapters are published to engines of kind {able} "
                             f"only; rollout.engine={kind} servers do not load adapters yet: set "
                             f"rollout.engine to one of {able}, or model.lora.rank=null to publish full "
                             "weights")
        if self.runtime.backend == "ray" and self.ray.weights == "object_store":
            raise FieldError("model.lora.rank", "LoRA adapters are published as files in RUN/weights; "
                             "ray.weights=object_store carries full weights only: set ray.weights=shared_fs, "
                             "or model.lora.rank=null")
        if importlib.util.find_spec("peft") is None:
            raise FieldError("model.lora.rank", "LoRA needs the peft package: pip install 'saorl[lora]' "
                             "(or pip install 'peft==0.21.*'); or set model.lora.rank=null")

    @property
    def worker_processes(self) -> int:
        """Rollout worker processes the run starts beside the trainer (0 on the in-process backend)."""
        return 0 if self.runtime.backend == "inprocess" else self.rollout.num_workers

    def trainer_threads(self, cores: int | None = None) -> int:
        """Torch threads for the trainer (``runtime.trainer_threads``, else what the rollout workers
        leave of the machine's ``cores``, shared by the trainer ranks of this machine when it is sharded)."""
        if self.runtime.trainer_threads:
            return self.runtime.trainer_threads
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.trainer.shard == "fsdp2" else 1
        free = (cores or os.cpu_count() or 1) - self.worker_processes * self.runtime.worker_threads
        return max(1, free // ranks)

    def resolved_mode(self, preset: AlgoPreset | None = None) -> Literal["async", "sync"]:
        """``runtime.mode``, with ``auto`` replaced by the algorithm preset's mode (``preset``: the
        one already resolved from this config; None resolves it)."""
        if self.runtime.mode != "auto":
            return self.runtime.mode
        return (preset or self.algo.preset).mode
