"""The one config tree: pydantic models per component, YAML presets, dotted overrides.

A run's configuration is :class:`SaorlConfig`. It is built from, in order: the defaults below
(which work on a laptop CPU), a YAML file (a path, or the name of a preset shipped with saorl:
``sao_math_tool`` is ``configs/sao_math_tool.yaml``, see :func:`find_config`), then command-line overrides of
the form ``section.field=value`` whose values are parsed by YAML rules (``algo.eps_high=3.0``,
``model.critic=null``, ``env.options.difficulty=2``, ``run.name='[a, b]'``).

Every bad value fails at load, never mid-run, with :class:`ConfigError`: one paragraph naming the
file, the dotted path of the field and the reason (unknown keys get a "did you mean" hint).

The ``algo`` section holds a preset name plus optional overrides (``None`` = the preset's value);
its fields, documentation and rules are derived from :class:`saorl.algo.presets.AlgoPreset`, where
each setting is declared once, and :meth:`AlgoConfig.resolve` returns the frozen preset the trainer
uses. Because ``None`` means "keep the preset's value", the preset fields that are themselves
optional (``vapo_alpha``, ``value_clip``) can be changed to another number here but not switched
off; pick a preset that has them off instead.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)


def plain_name(v: str) -> str:
    """``v`` if it can name a directory (non-empty, no path separators, not ``.``/``..``)."""
    if not v or "/" in v or "\\" in v or v in (".", ".."):
        raise ValueError(f"must be a non-empty name without path separators, got {v!r}")
    return v


class ConfigError(Exception):
    """A config that cannot be loaded; the message is one paragraph naming file, field and reason."""


class _FieldError(ValueError):
    """A cross-field check that failed on ``field`` (a dotted path relative to the model raising it)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")
"""Tracker names ``run.report_to`` accepts: accelerate's (``saorl.runtime.trackers``)."""


# ------------------------------------------------------------------------------------- sections
class RunConfig(_Section):
    out_dir: str = "runs"
    """Directory under which the run directory ``<out_dir>/<name>`` is created."""
    name: str = "sao-math_tool"
    """Run name: the run directory's name (no path separators)."""
    eval_every: int = Field(25, ge=1)
    """Evaluate on the test split every this many trainer steps."""
    eval_tasks: int = Field(128, ge=0)
    """Test tasks per evaluation (at most ``env.num_test_tasks`` are available). 0: no evaluation
    during the run, not even at step 0 — for models too big to evaluate on the trainer (a sharded
    trainer evaluates a full copy of the policy on rank 0's CPU); evaluate exported checkpoints with
    ``saorl eval`` instead."""
    eval_temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature of evaluation episodes: 1.0 measures the policy RL trains (mean
    success of sampled episodes, seeded so every evaluation sees the same random stream);
    0 is greedy decoding."""
    checkpoint_every: int = Field(50, ge=1)
    """Write a checkpoint every this many trainer steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted."""
    samples_every: int = Field(25, ge=1)
    """Write a few decoded trajectories to the run directory every this many trainer steps."""
    progress: bool = True
    """Show a live progress display on the terminal."""
    report_to: list[str] = Field(default_factory=lambda: ["tensorboard"])
    """Trackers that get every step's metrics besides ``metrics.jsonl`` (always written): any of
    ``tensorboard`` (in ``RUN/tb``), ``wandb``, ``mlflow``, ``comet_ml``, ``aim``, ``clearml``,
    ``dvclive``, ``swanlab``, ``trackio`` (accelerate's trackers; all but tensorboard are optional
    installs, e.g. ``pip install 'saorl[wandb]'``); ``[]`` for none."""
    tracker_project: str = "saorl"
    """Project (W&B) or experiment (MLflow) name the trackers file the run under; the tracker's
    run name is the run directory's name."""
    tracker_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Keyword arguments per tracker for its init call, e.g. ``{wandb: {entity: me, mode: offline}}``."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return plain_name(v)

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in TRACKERS:
                hint = difflib.get_close_matches(name, TRACKERS, n=1)
                raise ValueError(f"unknown tracker {name!r}" + (f" (did you mean {hint[0]}?)" if hint else "")
                                 + f"; known: {', '.join(TRACKERS)}")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _options_for_named(self) -> RunConfig:
        for name in self.tracker_options:
            if name not in self.report_to:
                raise _FieldError("tracker_options", f"options for {name!r}, which run.report_to does not "
                                  f"name ({self.report_to}); add it there or remove its options")
        return self


class ModelConfig(_Section):
    policy: str = "tiny-moe"
    """Policy: a tiny built-in kind (``tiny-moe``, ``tiny-dense``), a local Hugging Face model
    directory (config.json + safetensors + tokenizer files) or a Hugging Face Hub model id
    (``org/name``, taken from the local Hugging Face cache or downloaded into it)."""
    critic: str | None = None
    """Directory of a value-pretrained critic; None initialises the critic from the policy."""
    tokenizer: str | None = None
    """Tokenizer directory or Hub id; None (the default) uses the policy's own tokenizer (the shipped
    one for tiny kinds). Every stage (warm start, value pretraining, rollouts, evaluation, export)
    uses this one tokenizer; one whose vocabulary differs from the policy's own is an error."""
    chat_template: bool = True
    """Format each prompt with the tokenizer's chat template (one user message, then the generation
    prompt) when the tokenizer has one; false: the prompt text after the tokenizer's own leading
    special tokens (its BOS, if it adds one). The shipped tokenizer has no template."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, e.g. ``{enable_thinking: false}`` for Qwen3."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of policy and critic. ``float16`` (CUDA or MPS only) samples in float16 and
    trains in float32, since AdamW on float16 parameters turns them NaN (docs/models.md)."""
    device: str = "cpu"
    """Torch device for the trainer and the local engine: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""

    @field_validator("policy")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a tiny kind, a model directory or a Hub model id")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", v):
            raise ValueError(f"must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {v!r}")
        return v

    @model_validator(mode="after")
    def _half_on_cpu(self) -> ModelConfig:
        if self.dtype == "float16" and self.device == "cpu":
            raise _FieldError(
                "dtype", "float16 needs model.device=cuda or mps (GPUs without bfloat16, e.g. V100, T4): on "
                "CPU half-precision kernels are slow or missing; use float32 or bfloat16 on CPU")
        return self


class DatasetConfig(_Section):
    path: str
    """A local dataset: a directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict``
    holding the splits below), or a directory with one file per split (``train.parquet``,
    ``test.jsonl``, or shards ``train-*.parquet``, also under ``data/``). Never a Hub name:
    download it first (``datasets.load_dataset(NAME).save_to_disk(DIR)``)."""
    train_split: str = "train"
    """The split trained on."""
    test_split: str | None = "test"
    """The held-out split evaluated on (no task may be in both); null = hold out the last
    ``env.num_test_tasks`` tasks of the train split."""

    @field_validator("path", "train_split", "test_split")
    @classmethod
    def _nonempty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _distinct(self) -> DatasetConfig:
        if self.test_split == self.train_split:
            raise _FieldError("test_split", f"is the train split ({self.train_split!r}) too: a model "
                                            "would be evaluated on what it trained on")
        return self


class EnvConfig(_Section):
    type: str = "math_tool"
    """Environment: a built-in name (``math_tool``, ``math_levels``, ``noisy_lookup``,
    ``code_repair``, ``style_shift``, ``synthetic``, ``prompt_reward``) or ``module.path:ClassName``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the env class (e.g. ``difficulty: 2``); checked when the env is built."""
    tasks_file: str | None = None
    """Training tasks used instead of the env's task generator: a JSONL file (format:
    ``saorl.data.tasks``), a ``.parquet`` file, or a ``datasets`` directory of one split
    (``save_to_disk``). Without ``test_tasks_file``, its last ``num_test_tasks`` tasks are held out
    as the test split and never trained on. Before anything runs, every task of the file(s) is
    passed to the env's ``reset`` once, so a row the env rejects stops the run at start, named by
    file and row (for an env whose reset is slow, as many as 10 seconds allow)."""
    test_tasks_file: str | None = None
    """Held-out test tasks, in any format ``tasks_file`` takes (needs ``tasks_file``); no id may be
    in both."""
    dataset: DatasetConfig | None = None
    """Train and test tasks from one local dataset with named splits (instead of ``tasks_file``)."""
    id_column: str | None = None
    """Parquet and dataset rows: the column holding unique task ids; null = an ``id`` column if
    there is one, else a hash of each row's content (so a row in both splits is caught)."""
    num_train_tasks: int = Field(5000, ge=1)
    """Training tasks drawn from the env's generator or the file (cycled when exhausted)."""
    num_test_tasks: int = Field(128, ge=1)
    """Held-out test tasks: drawn from the env's generator, or held out of ``tasks_file``."""

    @model_validator(mode="after")
    def _files(self) -> EnvConfig:
        if self.test_tasks_file and not self.tasks_file:
            raise _FieldError("test_tasks_file", "needs env.tasks_file (the training tasks) too")
        if self.dataset is not None and (self.tasks_file or self.test_tasks_file):
            raise _FieldError("dataset", "give the tasks either as env.dataset or as env.tasks_file / "
                                         "env.test_tasks_file, not both")
        return self

    @field_validator("type")
    @classmethod
    def _env_type(cls, v: str) -> str:
        if ":" in v:
            module, _, name = v.partition(":")
            if not module or not name:
                raise ValueError(f"must be a built-in name or 'module.path:ClassName', got {v!r}")
            return v
        try:
            from saorl.envs.registry import BUILTIN_ENVS
        except ImportError:  # pragma: no cover - the env package is part of saorl
            return v
        if v not in BUILTIN_ENVS:
            raise ValueError(
                f"unknown env {v!r}; built-ins: {sorted(BUILTIN_ENVS)}, or use 'module.path:ClassName'"
            )
        return v


class RolloutConfig(_Section):
    num_workers: int = Field(1, ge=1)
    """Rollout worker processes, each with its own inference engine."""
    concurrent_episodes: int = Field(16, ge=1)
    """Episodes in flight per worker (their turns are batched by the engine)."""
    engine_slots: int = Field(16, ge=1)
    """Sequences the local engine decodes together (its batch size)."""
    prefix_cache_tokens: int = Field(65536, ge=0)
    """Tokens of KV cache the local engine keeps between the turns of its episodes, so a turn
    prefills only the new observation tokens (0 = off: every turn re-prefills its context)."""
    prefix_after_update: Literal["recompute", "keep"] = "keep"
    """What a weight update does to the kept KV: ``keep`` lets the next turn continue on KV
    computed by older weights, as a sequence in flight during an update does (each token's
    log-prob and version stay those of the weights that drew it; DIS absorbs the older context;
    in async runs, where weights change every step, ~1.6× the trained tokens/s of ``recompute``,
    docs/performance.md); ``recompute`` drops it, so the next turn re-prefills its context with
    the new weights and every turn is sampled exactly as after a full re-prefill."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy). RL needs samples from the policy itself: keep 1.0 for training."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold in (0, 1] (1 disables). Allowed with every engine because the
    trainer scores log-probs under the same truncation (top-k, then top-p), so the DIS ratio
    compares like with like."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 disables); scored by the trainer under the same truncation, as ``top_p``."""
    max_new_tokens: int = Field(48, ge=1)
    """Tokens the policy may sample per turn."""
    max_total_tokens: int = Field(384, ge=2)
    """Tokens per trajectory (prompt + all turns); the episode is truncated past it."""
    engine: Literal["local", "http", "vllm", "sglang"] = "local"
    """``local``: the in-process torch engine; ``http``: ``saorl serve`` at ``http_url`` (or
    ``engine_urls``); ``vllm`` / ``sglang``: servers the user started at ``engine_urls``, which the
    trainer updates in place after every step (docs/engines.md: versions, launch flags)."""
    http_url: str | None = None
    """Base URL of the ``saorl serve`` server (``engine: http``; or list it in ``engine_urls``)."""
    engine_urls: list[str] = Field(default_factory=list)
    """Base URLs (``http://host:port``) of the inference servers for ``engine: vllm | sglang``
    (required) or ``http``; each worker spreads its requests over all of them."""
    engine_routing: Literal["least_loaded", "round_robin"] = "least_loaded"
    """How a worker picks a server per request: the one with the fewest of its requests in flight,
    or in turn."""
    engine_model: str | None = None
    """The served model name sent as ``model`` to vLLM (its ``--served-model-name``); None sends
    none (the server's only model)."""
    sglang_pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How SGLang pauses for a weight update: ``abort`` returns requests in flight at once and the
    client continues them with the new weights (exact per-token versions, KV recomputed);
    ``retract`` / ``in_place`` keep them on the server (their cached KV was computed by the old
    weights)."""
    weight_update_timeout_s: float = Field(600.0, gt=0.0)
    """Watchdog of one weight update on a server (pause + load); past it the run stops with an
    error naming the server (the server is resumed first)."""
    logprob_probe_tol: float = Field(0.1, ge=0.0)
    """With ``vllm`` / ``sglang``: at start, one request per server is compared with the trainer's
    log-probs of the same tokens (same temperature and truncation); a mean gap above this many
    nats per token stops the run (e.g. vLLM without ``--logprobs-mode processed_logprobs``)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The local engine's own parameter dtype (None: ``model.dtype``); the trainer keeps
    ``model.dtype``. An engine in lower precision than the trainer is the engine/trainer mismatch of
    real deployments, which DIS exists to absorb."""
    moe_top_k: int | None = Field(None, ge=1)
    """The local engine routes each token to this many experts (None: the model's own); the trainer
    keeps the model's. A dial for engine/trainer routing mismatch (MoE policies only)."""
    router_noise: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """The local engine picks experts from router logits plus N(0, σ²) noise, σ = this (the picked
    experts' weights stay the router's own probabilities); 0 = none. MoE policies only."""

    @field_validator("engine_urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        bad = [u for u in v if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", u)]
        if bad:
            raise ValueError(f"each URL must look like http://host:port, got {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"a URL is listed twice: {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.engine == "http" and not (self.http_url or self.engine_urls):
            raise _FieldError("http_url", "required when engine is 'http' (or set rollout.engine_urls)")
        if self.engine != "local":
            for name in ("dtype", "moe_top_k", "router_noise"):
                if getattr(self, name):
                    raise _FieldError(name, "changes the local engine only; rollout.engine is "
                                            f"{self.engine!r}")
        if self.engine in ("vllm", "sglang") and not self.engine_urls:
            raise _FieldError("engine_urls", f"required when engine is {self.engine!r}: the base URLs of "
                              f"the {self.engine} servers you started, e.g. "
                              "rollout.engine_urls='[http://127.0.0.1:8000]'")
        if self.max_new_tokens >= self.max_total_tokens:
            raise _FieldError(
                "max_new_tokens",
                f"max_new_tokens ({self.max_new_tokens}) must be smaller than max_total_tokens "
                f"({self.max_total_tokens}), which also holds the prompt",
            )
        return self


class _AlgoSection(_Section):
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

    @model_validator(mode="after")
    def _resolvable(self) -> _AlgoSection:
        from saorl.algo.presets import SettingError

        try:
            self.resolve()  # the preset's own checks (ranges; e.g. grpo needs group_size >= 2)
        except SettingError as e:
            raise _FieldError(e.field, f"algorithm {self.name!r}: {e.reason}") from None
        return self

    def overrides(self) -> dict[str, Any]:
        """The fields set here (not None), i.e. what changes relative to the preset."""
        return {k: v for k, v in self.model_dump().items() if k != "name" and v is not None}

    def resolve(self) -> Any:
        """The preset ``name`` with the non-None overrides applied (an ``AlgoPreset``)."""
        from saorl.algo.presets import get_preset

        return get_preset(self.name).with_overrides(**self.overrides())


NOT_IN_CONFIG = ("name", "mode")
"""Preset fields the ``algo`` section does not override: ``name`` picks the preset, and the
schedule is ``runtime.mode``."""


def _algo_config() -> type[_AlgoSection]:
    """``AlgoConfig``: every other preset field, optional (None = the preset's value), with the
    preset's own documentation and rule. A setting is declared once, in the preset."""
    from saorl.algo.presets import setting_docs, setting_rules, setting_types

    docs, rules = setting_docs(), setting_rules()
    fields: dict[str, Any] = {}
    for name, hint in setting_types().items():
        if name in NOT_IN_CONFIG:
            continue
        rule = f" Must be {rules[name]}." if rules[name] else ""
        fields[name] = (hint | None, Field(None, description=f"{docs[name]}{rule} None: the preset's value."))
    return create_model("AlgoConfig", __base__=_AlgoSection, __module__=__name__, **fields)


AlgoConfig = _algo_config()


class TrainerConfig(_Section):
    batch_size: int = Field(4, ge=1)
    """Trajectories per policy update (a multiple of the preset's group size)."""
    steps: int = Field(200, ge=1)
    """Policy updates to run."""
    max_wall_s: float | None = Field(None, gt=0.0)
    """Stop (with a final checkpoint) after this many seconds; None = no limit."""
    policy_lr: float = Field(1e-4, gt=0.0)
    """AdamW learning rate of the policy."""
    critic_lr: float = Field(1e-3, gt=0.0)
    """AdamW learning rate of the critic."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (policy and critic)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value (policy and critic separately)."""
    max_staleness: int | None = Field(None, ge=0)
    """Drop trajectories whose oldest action token is more than this many versions old (counted
    in the metrics); None = no limit."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many steps (0 = none)."""
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
    (less memory for long sequences, about a third more compute); policy and critic."""
    max_tokens_per_microbatch: int = Field(4096, ge=1)
    """Token budget of one forward/backward pass of the policy or the critic: a batch is cut into
    micro-batches of at most this many positions and gradients accumulate across them; losses
    are still normalised by the whole batch's token counts. A trajectory longer than the budget
    gets a micro-batch of its own (nothing is truncated)."""
    packing: bool = True
    """Pack the trajectories of a micro-batch end to end in one row with no padding (sequence
    boundaries through per-sequence position ids; every HF causal LM with sdpa, eager or
    flash-attention honours them). False: right-padded micro-batches of similar lengths, for a
    model whose attention ignores restarting position ids."""


class RuntimeConfig(_Section):
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

    @field_validator("backend")
    @classmethod
    def _ray_installed(cls, v: str) -> str:
        import importlib.util

        if v == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("'ray' needs Ray installed: pip install -e \".[ray]\" (or pip install ray)")
        return v


class RayConfig(_Section):
    """Where and how the Ray backend (``runtime.backend: ray``) places rollout workers."""

    address: str | None = None
    """Address of a running Ray cluster (``auto``, ``ray://host:10001``, ``host:6379``); None
    starts a private local cluster for the run and stops it at the end."""
    num_cpus: float | None = Field(None, gt=0.0)
    """Logical CPUs of the private local cluster (None: the machine's cores); ignored with
    ``address``."""
    num_gpus: int | None = Field(None, ge=0)
    """GPUs of the private local cluster (None: those Ray detects); ignored with ``address``."""
    temp_dir: str | None = None
    """Session directory of the private local cluster; None makes a short one under /tmp (Ray's
    Unix socket paths must stay under 107 bytes). Removed at shutdown."""
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
    """Seconds to wait for the cluster to grant the placement group before failing."""


class SFTConfig(_Section):
    enabled: bool = True
    """Before RL, fine-tune the initial policy on the env's demonstrations (loss on action tokens
    only): the "SFT model" RL starts from. Cached under ``run.out_dir/.cache``, so runs with the
    same policy, env, seed and SFT settings share one."""
    steps: int = Field(1000, ge=1)
    """Optimizer steps of supervised fine-tuning."""
    batch_size: int = Field(32, ge=1)
    """Demonstrations per SFT step."""
    lr: float = Field(3e-3, gt=0.0)
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    num_demos: int = Field(2000, ge=1)
    """Demonstrations generated from training tasks (the env's ``demo_error_rate`` option says
    how many of them are deliberately wrong)."""
    seed: int | None = None
    """Seed of the demonstrations and of SFT; null = the run's ``seed``. Fix it to start runs of
    different seeds from one SFT model (as the experiments do)."""


class ValuePretrainConfig(_Section):
    enabled: bool = True
    """Before RL, fit the critic on Monte-Carlo returns of rollouts of the initial policy, when the
    algorithm preset asks for it (``algo.value_pretrain``). Cached under ``run.out_dir/.cache``."""
    rollouts: int = Field(128, ge=2)
    """Rollouts of the initial policy sampled (one per training task); 20% are held out for the
    validation loss and explained variance."""
    steps: int = Field(100, ge=1)
    """Critic optimizer steps of each fit (one fit per data fraction: 25%, 50%, 100%)."""
    batch_size: int = Field(16, ge=1)
    """Rollouts per critic step."""
    lr: float = Field(1e-3, gt=0.0)
    """AdamW learning rate of the critic during value pretraining."""


class SaorlConfig(_Section):
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
        group = self.algo.resolve().group_size
        if self.trainer.batch_size % group:
            raise _FieldError(
                "trainer.batch_size",
                f"{self.trainer.batch_size} is not a multiple of the group size "
                f"({group}, algo {self.algo.name!r}): every update takes whole groups; set "
                f"trainer.batch_size to a multiple of {group} (e.g. trainer.batch_size={group})"
            )
        if self.trainer.shard == "fsdp2" and self.model.device == "mps":
            raise _FieldError("trainer.shard", "fsdp2 shards over gloo (model.device=cpu) or NCCL "
                                               "(model.device=cuda), not mps; set trainer.shard=none")
        engine, shard = self.rollout.engine, self.trainer.shard
        if self.algo.resolve().routing_replay and (engine != "local" or shard != "none"):
            raise _FieldError("algo.routing_replay", "the local engine records routes and the unsharded "
                              "trainer replays them; other engines and trainer.shard=fsdp2 do not yet "
                              f"(rollout.engine={engine!r}, trainer.shard={shard!r})")
        return self

    def resolved_mode(self) -> Literal["async", "sync"]:
        """``runtime.mode``, with ``auto`` replaced by the algorithm preset's mode."""
        return self.algo.resolve().mode if self.runtime.mode == "auto" else self.runtime.mode


# --------------------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=1"`` → ``(["a", "b"], 1)``; the value is parsed by YAML rules."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {item!r}: expected 'section.field=value'")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"bad override {item!r}: empty name in the dotted path {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {item!r}: value is not valid YAML ({_one_line(str(e))})") from None
    return parts, value


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], schema: type[BaseModel] | None = SaorlConfig
) -> dict[str, Any]:
    """A deep copy of ``data`` with each ``"a.b=value"`` applied, in order.

    With a ``schema`` (default :class:`SaorlConfig`), each dotted path is checked against it
    first, so a typo fails here, naming the override. Free-form dict fields (``env.options``)
    accept any key below them.
    """
    out = copy.deepcopy(dict(data))
    for item in overrides:
        parts, value = parse_override(item)
        if schema is not None:
            _check_path(schema, parts, item)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"bad override {item!r}: {where} is a value ({child!r}), not a section")
            node = child
        node[parts[-1]] = value
    return out


def _check_path(schema: type[BaseModel], parts: list[str], item: str) -> None:
    model: type[BaseModel] | None = schema
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if model is None:
            raise ConfigError(f"bad override {item!r}: {'.'.join(parts[:i])} is a value, not a section")
        fields = model.model_fields
        if part not in fields:
            raise ConfigError(f"bad override {item!r}: {where}: {_unknown(part, list(fields))}")
        annotation = _section_type(fields[part].annotation)
        if annotation is not None:
            model = annotation
        elif _is_free_dict(fields[part].annotation):
            return
        else:
            model = None


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field annotated ``Section`` or ``Section | None``, else None."""
    for a in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _is_free_dict(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict or annotation is dict


def _unknown(name: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if hint:
        return f"unknown field (did you mean {hint[0]}?)"
    return f"unknown field; known fields: {', '.join(known)}"


# ------------------------------------------------------------------------------------- loading
class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config error: file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"config error: cannot read {path}: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"config error in {path}: YAML syntax error{where}: {_one_line(reason)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config error in {path}: YAML error: {_one_line(str(e))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config error in {path}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    return data


PRESET_DIR = Path(__file__).resolve().parent / "configs"
"""The YAML presets shipped with saorl: package data, which is ``configs/`` in a source checkout
(``saorl/configs`` links to it)."""


def preset_names() -> list[str]:
    """The run-config presets shipped with saorl, by name (``sao_math_tool``, ...)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def find_config(name: str | os.PathLike) -> Path:
    """The YAML file ``name`` names: an existing path; else a preset shipped with saorl, by name
    (``sao_math_tool`` or ``sao_math_tool.yaml``) or by its path in a checkout
    (``configs/sao_math_tool.yaml``), so the documented commands work from an installed wheel in any
    directory. :class:`ConfigError` listing the presets otherwise."""
    path = Path(name).expanduser()
    if path.exists() or path.is_absolute():
        return path
    rel = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) and len(path.parts) > 1 else path
    for candidate in (PRESET_DIR / rel, PRESET_DIR / f"{rel}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config error: file not found: {name} (not a path from here, nor a preset shipped "
                      f"with saorl; presets: {', '.join(preset_names())})")


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> SaorlConfig:
    """Defaults ← YAML file at ``path`` (None: defaults only; a preset name works, see
    :func:`find_config`) ← dotted ``overrides``."""
    if path is not None:
        path = find_config(path)
    source = str(path) if path is not None else "<defaults>"
    data = _read_yaml(Path(path)) if path is not None else {}
    overrides = list(overrides)
    try:
        data = apply_overrides(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"config error in {source}: {e}") from None
    return config_from_dict(data, source + (" with overrides" if overrides else ""))


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> SaorlConfig:
    """Validate a plain dict; ``ConfigError`` (naming ``source``) on any problem."""
    try:
        return SaorlConfig.model_validate(dict(data))
    except ValidationError as e:
        reasons = "; ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"config error in {source}: {reasons}") from None


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(x) for x in err["loc"]]
    error = err.get("ctx", {}).get("error")
    if isinstance(error, _FieldError):
        loc = [*loc, error.field]
    path = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{path}: {_unknown(loc[-1], _known_fields(loc[:-1]))}"
    if err["type"] == "value_error":
        return f"{path}: {_one_line(str(error))}"
    if err["type"] == "missing":
        return f"{path}: required field missing"
    return f"{path}: {_one_line(err['msg'])} (got {_short(err.get('input'))})"


def _known_fields(loc: list[str]) -> list[str]:
    model: type[BaseModel] = SaorlConfig
    for part in loc:
        section = _section_type(model.model_fields[part].annotation) if part in model.model_fields else None
        if section is None:
            return []
        model = section
    return list(model.model_fields)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------- output
def config_to_dict(cfg: SaorlConfig) -> dict[str, Any]:
    """Plain, YAML/JSON-safe dict of the config, in field order."""
    return cfg.model_dump(mode="json")


def config_to_yaml(cfg: SaorlConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def resolved_algo_dict(cfg: SaorlConfig) -> dict[str, Any]:
    """The resolved algorithm preset as a dict."""
    return dataclasses.asdict(cfg.algo.resolve())


def absolute_paths(cfg: SaorlConfig) -> SaorlConfig:
    """A copy of ``cfg`` whose paths are absolute (resolved against the working directory), so that it
    means the same from any directory: a run's saved ``config.yaml`` (``--resume`` from elsewhere) and
    the keys of the SFT and value-pretraining caches.

    ``run.out_dir``, the task files and ``env.dataset.path`` are always paths; ``model.policy``,
    ``model.tokenizer`` and ``model.critic`` are made absolute only when they name an existing path
    (a tiny kind stays as it is).
    """
    out = cfg.model_copy(deep=True)

    def absolute(p: str) -> str:
        return os.path.abspath(os.path.expanduser(p))

    out.run.out_dir = absolute(out.run.out_dir)
    for section, name in (("env", "tasks_file"), ("env", "test_tasks_file"), ("model", "policy"),
                          ("model", "tokenizer"), ("model", "critic")):
        sec = getattr(out, section)
        value = getattr(sec, name)
        if value and (section == "env" or os.path.exists(os.path.expanduser(value))):
            setattr(sec, name, absolute(value))
    if out.env.dataset is not None:
        out.env.dataset.path = absolute(out.env.dataset.path)
    return out


def save_resolved(cfg: SaorlConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``config.yaml`` (loadable by :func:`load_config`) and ``algo_resolved.yaml`` to ``run_dir``.

    Returns the path of ``config.yaml``. Files are written atomically (temp file + rename).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    _write_atomic(path, config_to_yaml(cfg))
    header = "# The algorithm preset after overrides (informational; config.yaml is the source).\n"
    _write_atomic(run_dir / "algo_resolved.yaml",
                  header + yaml.safe_dump(resolved_algo_dict(cfg), sort_keys=False))
    return path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
