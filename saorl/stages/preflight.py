"""Start-up checks: what a run needs from the world, checked before anything runs.

:func:`check_run` is the first thing :func:`saorl.training.train` does, before the SFT warm start,
value pretraining and the run directory, so a mistake costs a second, not an hour of SFT, and
leaves nothing behind. Each problem raises :class:`~saorl.errors.StartupError`: one paragraph
naming the setting, what is wrong and the fix. In order, cheapest first:

1. the trackers of ``run.report_to`` are installed, and the env: its class imports and accepts
   ``env.options`` (the accepted options are listed);
2. the models: ``model.policy`` is a tiny kind, a local HF model directory (``config.json`` +
   ``*.safetensors``) or a Hub id (found in the local cache, or downloaded now when the Hub can be
   reached: :mod:`saorl.models.hub`), ``model.tokenizer`` and ``model.critic`` (when the algorithm
   trains a critic) are directories of the right kind;
3. the device: ``model.device`` exists on this machine; with ``chat`` observations
   (``env.observation_format``, or the env's own), the run's tokenizer has a chat template that
   adds a probe episode's two observations as turns, token-exactly
   (:func:`saorl.models.chat_turns.check_chat_turns`), so a template that cannot stops the start,
   not the first multi-turn rollout;
4. the tasks: the task files or ``env.dataset`` parse (a bad line is named by file and line), and
   the env accepts their tasks: **every task read from a file** (train and test split) is passed
   to a fresh env's ``reset`` once, in file order, and the first one the env rejects is named by
   file, row and id; a prompt that is a conversation (chat messages) is rendered through the run's
   tokenizer, so a tokenizer without a chat template, or a template that refuses the messages (a
   system message, say), is named by the same row.
   Built-in resets take microseconds, so this is all of them in well under a second; for an env
   whose reset is slow the check stops after :data:`TASK_CHECK_BUDGET_S` seconds (at least the
   first task of each split is always checked) and the rest are checked as they are played. Tasks
   from the env's own generator are the env's contract; of those only the first 4 test tasks are
   reset, and a conversation among their prompts rendered (a ``reasoning_gym`` prompt given as chat
   messages to a tokenizer without a chat template stops the start here);
5. with ``sft.enabled``, the env has demonstrations: one is played on the first training task.

Between 1 and 2, a recipe's task files that ``env.prepare`` makes are made when missing
(:func:`saorl.stages.env_check.prepare_tasks`), so ``saorl sft`` and ``saorl value_pretrain`` find
them as ``saorl train`` does.

:func:`check_servers` (called by :func:`saorl.training.train` after these, before the warm start:
SFT and value pretraining do not need the servers) checks that with ``rollout.engine: vllm`` every
server answers and none is one the run could not train on
(:func:`saorl.engines.clients.vllm_client.incompatibility`); :func:`check_ray`, next, that with
``runtime.backend: ray`` the cluster at ``ray.address`` answers within seconds and that the cluster
(or, for the private one, this machine) has the CPUs and GPUs the rollout workers and the trainer
ask for (:mod:`saorl.runtime.backends.ray_check`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

from saorl.config import ModelConfig, SaorlConfig
from saorl.config.engines import VllmEngineConfig
from saorl.data.task import Task
from saorl.data.tasks import TaskFileError, env_sources, load_split, source_name
from saorl.envs.base import Env, Progress, Prompt
from saorl.envs.registry import EnvFactory
from saorl.errors import StartupError
from saorl.models.codec import RunTokenizer, run_tokenizer
from saorl.runtime.trackers import TrackerUnavailable, check_trackers
from saorl.stages.env_check import check_env, prepare_tasks

TASK_CHECK_BUDGET_S = 10.0
"""Seconds the task check may spend resetting the env on file tasks (the first of each split is
always checked)."""


def check_run(cfg: SaorlConfig, *, demonstrations: bool | None = None,
              log: Callable[[str], None] = print) -> Callable[[], Env]:
    """Every check of the module docstring; returns the env factory. ``demonstrations``: whether the
    env must have them (None: when ``sft.enabled``, i.e. when a run's warm start needs them);
    ``log`` hears of a Hub model being fetched."""
    try:
        check_trackers(cfg.run.report_to)
    except TrackerUnavailable as e:
        raise StartupError(str(e)) from None
    factory = check_env(cfg)
    prepare_tasks(cfg)  # a recipe's generated task files, made on first use (env.prepare)
    check_models(cfg.model, use_critic=cfg.algo.preset.use_critic, log=log)
    check_learning_rates(cfg, log)
    check_device(cfg.model.device)
    check_observations(cfg, factory)
    check_tasks(cfg, factory)
    if cfg.sft.enabled if demonstrations is None else demonstrations:
        check_demonstrations(cfg, factory)
    return factory


# --------------------------------------------------------------------------------------- servers
def check_servers(cfg: SaorlConfig, infos: list | None = None) -> None:
    """With ``rollout.engine`` of kind ``vllm``: each server of ``rollout.engine.urls`` answers
    (:func:`describe_servers`, unless its ``infos`` are given), and can train ``model.policy``
    under the run's sampling and dtype, and with ``model.lora`` load its adapters
    (:func:`saorl.engines.clients.vllm_client.incompatibility`)."""
    r, e = cfg.rollout, cfg.rollout.engine
    if not isinstance(e, VllmEngineConfig):
        return
    from saorl.engines.clients.vllm_client import incompatibility
    from saorl.models.loading import moe_layout, policy_source

    infos = describe_servers(cfg) if infos is None else infos
    moe = moe_layout(policy_source(cfg.model.policy))[0] > 0
    processed = r.temperature not in (0.0, 1.0) or r.top_k > 0 or r.top_p < 1.0
    dtype = cfg.model.dtype if e.verify_tol is None else None  # an explicit tolerance accepts a mismatch
    for info in infos:
        problem = incompatibility(info, moe=moe, processed=processed, dtype=dtype,
                                  lora_rank=cfg.model.lora.rank)
        if problem:
            raise StartupError(f"rollout.engine=vllm: {problem}.")


def check_ray(cfg: SaorlConfig) -> None:
    """With ``runtime.backend: ray``: the cluster answers and can place the run's workers
    (:func:`saorl.runtime.backends.ray_check.check_cluster`)."""
    if cfg.runtime.backend != "ray":
        return
    from saorl.runtime.backends.ray_check import check_cluster

    check_cluster(cfg.ray, cfg.rollout.num_workers)


def describe_servers(cfg: SaorlConfig) -> list:
    """What each vLLM server of ``rollout.engine.urls`` says of itself (``ServerInfo``), asked of
    all at once; a server still starting is waited for about 12 s, one that never answers a
    connection 7 tries of 3 s; every one that does not answer is named in one StartupError."""
    from saorl.engines.base import EngineError
    from saorl.engines.clients.transport import HttpTransport
    from saorl.engines.clients.vllm_client import VllmAdmin

    urls = cfg.rollout.engine.urls
    transport = HttpTransport(urls, timeout_s=60.0, retries=6, backoff_s=0.2, connect_timeout_s=3.0)
    try:
        async def describe_all():
            return await asyncio.gather(*(VllmAdmin(u, transport).describe() for u in urls),
                                        return_exceptions=True)

        infos = transport.run(describe_all())
    finally:
        transport.close()
    failed = [f"{url} ({e})" for url, e in zip(urls, infos) if isinstance(e, EngineError)]
    if failed:
        raise StartupError(f"rollout.engine.urls: {len(failed)} of {len(infos)} vLLM servers do not answer: "
                           f"{'; '.join(failed)}. Start the servers before training (docs/engines.md has "
                           "the launch command) or fix the URLs")
    for e in infos:
        if isinstance(e, BaseException):
            raise e
    return infos


# ---------------------------------------------------------------------------------------- models
def check_models(m: ModelConfig, *, use_critic: bool, log: Callable[[str], None] | None = None) -> None:
    """``model.policy``, ``model.tokenizer`` and (with a critic) ``model.critic`` name usable things,
    each resolved here once for the process (:meth:`saorl.models.source.ModelSource.resolve`: a Hub
    download, a GGUF conversion); ``log`` hears when a Hub id is looked up (a download can take
    minutes, and ``saorl`` turns the Hub's progress bars off)."""
    from saorl.models.loading import check_model_dir
    from saorl.models.source import LOCAL_KINDS, ModelSourceError, accepted, parse

    try:
        policy = parse(m.policy, "model.policy")
        if log is not None and policy.kind == "hub":
            log(f"model.policy {m.policy}: a Hugging Face Hub model, taken from the local cache or "
                "downloaded into it now (HF_HUB_DISABLE_PROGRESS_BARS=0 shows the download's progress)")
        policy = policy.resolve()  # a Hub id: its snapshot in the local cache, downloaded if reachable
    except ModelSourceError as e:  # says what to do
        raise StartupError(str(e)) from None
    if not policy.tiny:
        try:
            check_model_dir(policy.local)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise StartupError(f"model.policy: {e}. It must be {accepted()}") from None
    if m.lora.enabled:
        check_lora_targets(m)
    if m.tokenizer is not None:
        try:
            path = parse(m.tokenizer, "model.tokenizer", LOCAL_KINDS).resolve().local
        except ModelSourceError as e:
            raise StartupError(str(e)) from None
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise StartupError(f"model.tokenizer={m.tokenizer}: holds no tokenizer.json or "
                               "tokenizer_config.json. Point it at a tokenizer directory (as save_pretrained "
                               "writes it) or a Hub id, or set model.tokenizer=null to use the policy's own")
    if use_critic and m.critic is not None:
        check_critic(m.critic)


CRITIC_KINDS = ("critic", "gguf", "directory", "registry", "hub")
"""What ``model.critic`` may be: a critic saorl wrote, or a model whose trunk starts the critic."""


def check_critic(spec: str) -> None:
    """``model.critic`` is a critic saorl wrote (``critic.json``) or a model whose trunk starts the
    critic: a model directory, a ``.gguf`` file, a short model name or a Hub id."""
    from saorl.models.loading import check_model_dir
    from saorl.models.source import ModelSourceError, accepted, parse

    null = ("; or set model.critic=null to initialise the critic from the policy (a model whose trunk starts "
            "the critic must read the policy's tokenizer)")
    try:
        source = parse(spec, "model.critic", CRITIC_KINDS)
    except ModelSourceError as e:
        raise StartupError(f"{e}{null}") from None
    if source.kind == "directory" and not (Path(spec).expanduser() / "config.json").is_file():
        raise StartupError(f"model.critic={spec}: holds neither critic.json nor config.json; it takes "
                           f"{accepted(CRITIC_KINDS)}{null}")
    if source.kind == "critic":
        return
    try:
        check_model_dir(source.resolve().local, "model.critic")
    except (FileNotFoundError, NotADirectoryError) as e:  # ModelSourceError included: says what to do
        raise StartupError(str(e)) from None


PRETRAINED_LR_LIMITS = {"policy_lr": 1e-5, "critic_lr": 1e-4}
"""Learning rates above which a pretrained policy gets a warning at start-up (docs/real-model.md):
the tiny models' defaults (1e-4 / 1e-3), set by hand for a pretrained model, turned SmolLM2-135M-
Instruct into a policy that ends every answer at once within 5 steps."""


def check_learning_rates(cfg: SaorlConfig, log: Callable[[str], None] | None) -> None:
    """A warning (not an error: a user may know better) when a pretrained policy is trained at
    learning rates sized for the tiny built-in models."""
    from saorl.models.source import is_tiny

    if log is None or is_tiny(cfg.model.policy):
        return
    high = {k: getattr(cfg.trainer, k) for k, limit in PRETRAINED_LR_LIMITS.items()
            if getattr(cfg.trainer, k) > limit}
    if high:
        said = ", ".join(f"trainer.{k}={v:g}" for k, v in high.items())
        log(f"warning: {said} for a pretrained model ({cfg.model.policy}): rates sized for the tiny built-in "
            f"models; measured on SmolLM2-135M-Instruct, policy 1e-4 / critic 1e-3 broke the policy within "
            f"5 steps. A pretrained model's defaults (the rates left unset) are policy 1e-5 / critic "
            f"5e-5, as the real-model recipes use (docs/real-model.md); watch rollout/action_tokens_mean "
            f"and mismatch/kl in metrics.jsonl")


def check_lora_targets(m: ModelConfig) -> None:
    """``model.lora.target_modules`` name linear modules of the policy (built on the meta device)."""
    from saorl.config.sections import LORA_TARGETS
    from saorl.models.loading import meta_policy, policy_source
    from saorl.models.lora import resolve_targets

    try:
        resolve_targets(meta_policy(policy_source(m.policy)), m.lora.target_modules, LORA_TARGETS)
    except ValueError as e:
        raise StartupError(str(e)) from None


def check_device(device: str) -> None:
    """``device`` (``cpu``, ``cuda[:N]``, ``mps``) is there on this machine."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            cuda = torch.version.cuda
            build = "a CPU-only build" if cuda is None else f"built for CUDA {cuda}"
            raise StartupError(f"model.device={device}: torch sees no CUDA device on this machine (torch "
                               f"{torch.__version__}, {build}). Set model.device=cpu, or run on a machine "
                               "with an NVIDIA GPU and a CUDA build of torch")
        if index and int(index) >= count:
            raise StartupError(f"model.device={device}: this machine has {count} CUDA device(s), "
                               f"cuda:0 to cuda:{count - 1}; pick one of them")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise StartupError(f"model.device={device}: the Apple MPS backend is not available here; "
                           "set model.device=cpu")


def check_observations(cfg: SaorlConfig, factory: EnvFactory, tokenizer: RunTokenizer | None = None) -> None:
    """With ``chat`` observations, the chat template of the run's tokenizer (``tokenizer``, else
    loaded from ``cfg.model``) adds a probe episode's observations as turns (see the module docstring)."""
    fmt, role = factory.observation
    if fmt != "chat":
        return
    from saorl.models.chat_turns import TemplateSplitError, check_chat_turns

    try:
        check_chat_turns(tokenizer or run_tokenizer(cfg.model), role)
    except TemplateSplitError as e:
        raise StartupError(str(e)) from None


# ----------------------------------------------------------------------------------------- tasks
def check_tasks(cfg: SaorlConfig, factory: Callable[[], Env],
                budget_s: float = TASK_CHECK_BUDGET_S) -> None:
    """Task files parse, and the env accepts every task read from them (see the module docstring)."""
    env = cfg.env
    train_src, test_src = env_sources(env)
    if train_src is None:
        _check_generated(cfg, factory)
        return
    try:
        train = load_split(factory(), env, "train", None, cfg.seed)
        test = load_split(factory(), env, "test", None, cfg.seed)
    except TaskFileError as e:
        raise StartupError(f"{e}. Fix the data or point {_source_setting(env)} at other data (JSONL: one "
                           "JSON object per line; parquet and datasets directories as docs/envs.md "
                           "says)") from None
    # row numbers as in the source: the test split is the test source, or the last tasks of the train one
    offset = 0 if test_src is not None else len(train)
    splits = [[(source_name(train_src), i + 1, t) for i, t in enumerate(train)],
              [(source_name(test_src or train_src), offset + i + 1, t) for i, t in enumerate(test)]]
    deadline = time.monotonic() + budget_s
    tokenizer = None
    for rows in splits:
        for j, (path, row, task) in enumerate(rows):
            if j > 0 and time.monotonic() > deadline:
                break  # a slow env: the rest are checked as they are played
            where = f"{path}: row {row} (task id {task.id!r})"
            _, prompt = _reset(factory, task, where, env.type)
            if isinstance(prompt, list):
                tokenizer = tokenizer or run_tokenizer(cfg.model)
                try:
                    tokenizer.prompt_ids(prompt)
                except ValueError as e:
                    raise StartupError(f"{where}: {e}") from None


def _check_generated(cfg: SaorlConfig, factory: Callable[[], Env], n: int = 4) -> None:
    """The first ``n`` generated test tasks (every part of a mix among them): a prompt that is a
    conversation renders through the run's tokenizer (one without a chat template cannot)."""
    try:
        tasks = load_split(factory(), cfg.env, "test", min(n, cfg.env.num_test_tasks), cfg.seed)
    except ValueError as e:
        raise StartupError(f"env {cfg.env.type} cannot make its test tasks: {e}") from None
    tokenizer = None
    for task in tasks:
        _, prompt = _reset(factory, task, f"generated task {task.id!r}", cfg.env.type)
        if isinstance(prompt, list):
            tokenizer = tokenizer or run_tokenizer(cfg.model)
            try:
                tokenizer.prompt_ids(prompt)
            except ValueError as e:
                raise StartupError(f"env {cfg.env.type}, task {task.id!r}: {e} (reasoning_gym gives them as "
                                   "text with env.options.prompt=text)") from None


def _source_setting(env) -> str:
    return "env.dataset.path" if env.dataset is not None else "env.tasks_file / env.test_tasks_file"


def _reset(factory: Callable[[], Env], task: Task, where: str, env_type: str) -> tuple[Env, Prompt]:
    env = factory()
    try:
        prompt = env.reset(task, Progress())
    except Exception as e:
        raise StartupError(f"{where}: env {env_type} rejects this task: {type(e).__name__}: {e}. Every task "
                           "must carry the fields the env's reset() reads (saorl envs sample "
                           f"{env_type} shows tasks it accepts); fix the row, or set env.type to the env the "
                           "file was written for") from None
    return env, prompt


def check_demonstrations(cfg: SaorlConfig, factory: Callable[[], Env]) -> None:
    """The env plays a demonstration on the first training task (the SFT warm start needs them)."""
    try:
        first = load_split(factory(), cfg.env, "train", 1, cfg.seed)
    except TaskFileError as e:
        raise StartupError(str(e)) from None
    if not first:
        raise StartupError(f"env {cfg.env.type} made no training tasks; raise env.num_train_tasks")
    env, _ = _reset(factory, first[0], f"training task {first[0].id!r}", cfg.env.type)
    try:
        env.demonstration(first[0], random.Random(0))
    except NotImplementedError as e:
        why = f" ({e})" if str(e) and "has no demonstrations" not in str(e) else ""
        raise StartupError(
            f"env {cfg.env.type} has no demonstrations{why}, so the SFT warm start (sft.enabled, on by "
            "default) has nothing to learn from. Set sft.enabled=false to start RL from model.policy as "
            "it is (best a model that already follows the env's action format), or give the env a "
            "demonstration(task, rng) method") from None
