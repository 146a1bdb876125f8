"""``saorl eval TARGET [MODEL] [key=value ...] [--tasks N] [--split test|train] [--show N] [--temperature T]``
(``TARGET``: a config file, then ``MODEL``; or the model alone).

Evaluates a policy on an env's test (or train) split, one episode per task, and prints accuracy,
mean reward, mean turns and mean action tokens as a small table. The sampling temperature is
``run.eval_temperature`` of the settings in force (1.0 unless the config says otherwise: the
accuracy of the policy as it samples, the number a run's ``eval/accuracy`` reports), so a run's
evaluation and this one compare; ``--temperature 0`` is greedy decoding.

``TARGET`` is one of:

- a config file (``.yaml``, e.g. a recipe): its env, test split and settings, and the policy
  ``MODEL`` when given (any of the targets below: a run directory, a checkpoint, a model
  directory, a LoRA adapter, a ``.gguf`` file, a short name, a tiny kind, a Hub id), else the
  config's own ``model.policy`` (the model before training, for the recipe's baseline). A run or
  checkpoint given as ``MODEL`` brings its own ``model`` section (tokenizer, chat template), the
  rest is the config's;
- a run directory (holds ``config.yaml``): env and rollout settings come from the run's config
  (overrides apply on top); the policy is ``RUN/final/policy`` when the run finished, else the
  latest checkpoint's ``policy.safetensors`` (stderr says which step, and that ``saorl train
  --resume RUN`` continues the run) loaded into the run's initial policy architecture (its
  cached SFT warm start when present, else ``model.policy``; SFT is never run here; a LoRA run's
  checkpoint holds the adapter, merged into that initial policy); a run with neither is refused,
  naming ``--resume``;
- a checkpoint directory ``RUN/checkpoints/step-N`` (holds ``manifest.json``): that checkpoint,
  with its run's config;
- an HF policy directory (``config.json`` + safetensors, e.g. ``RUN/final/policy`` or the output
  of ``saorl sft``): settings from the defaults plus overrides (default env: math_tool);
- a LoRA adapter directory (``adapter_config.json``, e.g. ``RUN/final/adapter``): the adapter
  merged into the base its ``saorl_base.json`` names; settings as for an HF directory;
- a tiny kind (``tiny-moe``, ``tiny-dense``): a freshly initialised model (from ``seed``);
- a ``.gguf`` file, a short model name (``smollm2-135m-instruct``, ``gemma3-270m``) or a Hugging Face
  Hub id: the model source it names (:mod:`saorl.models.source`: classified once, made local once, a GGUF
  converted once into saorl's cache); settings as for an HF directory.

The evaluation is the trainer's (:func:`saorl.stages.evaluate.evaluate_config`); the test tasks
are the first ``--tasks`` of the run's test split, so numbers compare with the run's ``eval/*``.
An episode whose reward function (or custom env call) runs past ``env.call_timeout_s`` is killed
and counts as failed (unsuccessful; the ``failed`` row), each named on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from saorl.config import ConfigError, SaorlConfig, load_config
from saorl.run_paths import RunPaths

if TYPE_CHECKING:  # torch is imported when a policy is loaded, not when the parser is built
    import torch

    from saorl.models.source import ModelSource

_ROWS = (("accuracy", "eval/accuracy", ".3f"), ("reward mean", "eval/reward_mean", ".3f"),
         ("turns mean", "eval/turns_mean", ".2f"), ("action tokens mean", "eval/action_tokens_mean", ".1f"),
         ("truncated frac", "eval/truncated_frac", ".3f"), ("episodes", "eval/episodes", ".0f"),
         ("failed (timed out)", "eval/failed", ".0f"))


class TargetError(ValueError):
    """An eval target that is none of: run dir, checkpoint dir, policy dir, tiny kind."""


@dataclass
class Target:
    cfg: SaorlConfig
    description: str
    """What is evaluated, for the table header (e.g. ``runs/x (final policy)``)."""
    load: Callable[[], torch.nn.Module]
    """Loads the policy (in eval mode); its tokenizer is the run's (``run_tokenizer(cfg.model)``)."""
    from_run: bool = False
    """A run directory or checkpoint: ``cfg.model`` is the run's (its tokenizer and template)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="CONFIG_OR_MODEL",
                   help="a config file (a recipe: its env, test split and settings; then MODEL, default its "
                        "model.policy), or the model alone: a run directory, a checkpoint directory, an HF "
                        "policy directory, a LoRA adapter directory, a tiny kind, a .gguf file, a short "
                        "model name (smollm2-135m-instruct, gemma3-270m) or a Hugging Face Hub id")
    p.add_argument("overrides", nargs="*", metavar="[MODEL] KEY=VALUE",
                   help="after a config file, the model to evaluate (any of the forms above); then dotted "
                        "config overrides, e.g. env.type=code_repair rollout.max_new_tokens=64")
    p.add_argument("--tasks", type=int, metavar="N",
                   help="episodes to run, one per task (default: run.eval_tasks, at most env.num_test_tasks)")
    p.add_argument("--split", choices=("test", "train"), default="test", help="task split (default: test)")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print the first N episodes")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: run.eval_temperature of the settings in force, 1.0 "
                        "unless the config sets it, as a run evaluates; 0 = greedy)")
    p.add_argument("--no-color", action="store_true",
                   help="label the parts of shown episodes instead of colouring them")
    p.add_argument("--json", action="store_true", help="print the metrics (and shown episodes) as JSON")


# ---------------------------------------------------------------------------------- targets
def _policy_loader(spec: str | ModelSource, cfg: SaorlConfig, state_file: Path | None = None) -> Callable:
    def load() -> torch.nn.Module:
        from saorl.models.loading import load_policy
        from saorl.models.serialize import load_safetensors

        model = load_policy(spec, dtype=cfg.model.dtype, device=cfg.model.device, seed=cfg.seed)
        if state_file is not None and cfg.model.lora.enabled:  # a LoRA run's checkpoint: its adapter
            from saorl.models.lora import load_adapter_state, merged_copy
            from saorl.runtime.parts import lora_policy

            model = lora_policy(cfg, model, spec if isinstance(spec, str) else spec.spec)
            load_adapter_state(model, load_safetensors(state_file, device=cfg.model.device))
            model = merged_copy(model)
        elif state_file is not None:
            model.load_state_dict(load_safetensors(state_file, device=cfg.model.device))
        return model.eval()
    return load


def _adapter_loader(path: Path, cfg: SaorlConfig) -> Callable:
    def load() -> torch.nn.Module:
        from saorl.models.lora import load_adapter_policy

        return load_adapter_policy(path, dtype=cfg.model.dtype, device=cfg.model.device)
    return load


def no_policy_yet(run_dir: Path) -> str:
    """The paragraph for a run directory with neither a final policy nor a checkpoint."""
    return (f"run directory {run_dir} has no final policy (final/policy) and no checkpoint yet: the run "
            "stopped (or was killed) before it wrote either, or it is still starting. Continue it with "
            f"saorl train --resume {run_dir} (it retrains from step 0 on what its journal kept), then "
            "evaluate the checkpoint it writes or its final policy")


def unfinished_note(run_dir: Path, ckpt: Path, step: int) -> str:
    """What a command says on stderr when it uses a run's last checkpoint for want of a final policy."""
    return (f"{run_dir} has no final policy (the run did not finish: killed, or still running); using its "
            f"last checkpoint, step {step} ({ckpt}). saorl train --resume {run_dir} continues the run")


def run_target(run_dir: Path, overrides: list[str], ckpt: Path | None = None) -> Target:
    from saorl.runtime.checkpoint import latest_checkpoint

    paths = RunPaths(run_dir)
    cfg = load_config(paths.config, overrides)
    final = paths.final_policy
    if ckpt is None and (final / "config.json").is_file():
        return Target(cfg, f"{final} (final policy)", _policy_loader(str(final), cfg), from_run=True)
    chosen = ckpt
    ckpt = ckpt or (latest_checkpoint(paths.checkpoints) if paths.checkpoints.is_dir() else None)
    if ckpt is None:
        raise TargetError(no_policy_yet(run_dir))
    if chosen is None:
        print(f"saorl eval: {unfinished_note(run_dir, ckpt, checkpoint_step(ckpt))}", file=sys.stderr)
    from saorl.stages.sft import initial_policy_spec

    spec = initial_policy_spec(cfg)
    return Target(cfg, f"{ckpt} (checkpoint, architecture of {spec})",
                  _policy_loader(spec, cfg, ckpt / "policy.safetensors"), from_run=True)


def checkpoint_step(ckpt: Path) -> int:
    """A checkpoint directory's step: its manifest's, else the number in its name (``step-N``)."""
    try:
        return int(json.loads((ckpt / "manifest.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        digits = ckpt.name.rpartition("-")[2]
        return int(digits) if digits.isdigit() else -1


def _config_target(config: str, model: str | None, overrides: list[str]) -> Target:
    """A config file's env and settings with ``model`` (default: its own ``model.policy``)."""
    if model is None:
        cfg = load_config(config, overrides)
        return _source_target(cfg.model.policy, cfg, f"{cfg.model.policy} (model.policy of {config})")
    inner = resolve_target(model, [o for o in overrides if o.startswith("model.")])  # a run's, overridden
    if inner.from_run:  # the run's model section (tokenizer, template), the config's env and settings
        cfg = load_config(config, overrides)
        cfg = cfg.model_copy(update={"model": inner.cfg.model})
        return Target(cfg, inner.description, inner.load, from_run=True)
    if Path(model).expanduser().joinpath("adapter_config.json").is_file():
        cfg = load_config(config, overrides)
        return Target(cfg, inner.description, _adapter_loader(Path(model).expanduser(), cfg))
    cfg = load_config(config, overrides, policy=inner.cfg.model.policy)
    return Target(cfg, inner.description, _policy_loader(cfg.model.policy, cfg))


def _source_target(spec: str, cfg: SaorlConfig, description: str) -> Target:
    """``spec`` (a tiny kind, a directory, a GGUF, a short name, a Hub id) under ``cfg``; a model
    source is made into its local directory now (converted once)."""
    from saorl.models.source import ModelSourceError, parse

    try:
        source = parse(spec, "model.policy").resolve()
    except ModelSourceError as e:
        raise TargetError(str(e)) from None
    return Target(cfg, description, _policy_loader(source, cfg))


def is_config_file(target: str) -> bool:
    return Path(target).suffix.lower() in (".yaml", ".yml")


def resolve_target(target: str, overrides: list[str], model: str | None = None) -> Target:
    """Config and policy loader for ``target`` (see the module docstring; ``model``: the MODEL after
    a config file); ``TargetError`` if none fits."""
    from saorl.models.source import ModelSourceError, parse

    if is_config_file(target):
        return _config_target(target, model, overrides)
    try:
        source = parse(target, "the eval target")
    except ModelSourceError as e:
        raise TargetError(f"{e}; or a run directory, a checkpoint directory or a LoRA adapter "
                          "directory") from None
    if source.tiny:
        cfg = load_config(None, overrides, policy=target)
        return Target(cfg, f"{target} (freshly initialised, seed {cfg.seed})", _policy_loader(source, cfg))
    path = Path(target).expanduser()
    if source.kind != "directory":  # a GGUF file, a short name, a Hub id: one local directory
        cfg = load_config(None, overrides, policy=str(path.resolve()) if path.exists() else target)
        try:
            local = parse(cfg.model.policy, "the eval target").resolve()
        except ModelSourceError as e:
            raise TargetError(str(e)) from None
        return Target(cfg, f"{target} ({local.local})", _policy_loader(local, cfg))
    if RunPaths(path).config.is_file():
        return run_target(path, overrides)
    if (path / "manifest.json").is_file() and (path / "policy.safetensors").is_file():
        run_dir = path.parent.parent
        if not RunPaths(run_dir).config.is_file():
            raise TargetError(f"checkpoint {path} is not inside a run directory "
                              f"({run_dir} has no config.yaml)")
        return run_target(run_dir, overrides, ckpt=path)
    if (path / "adapter_config.json").is_file():  # a LoRA adapter (final/adapter): on the base it names
        cfg = load_config(None, overrides)
        return Target(cfg, f"{path} (LoRA adapter, merged into its base)", _adapter_loader(path, cfg))
    if (path / "config.json").is_file():
        from saorl.models.loading import check_model_dir

        check_model_dir(path)
        cfg = load_config(None, overrides, policy=str(path))
        return Target(cfg, str(path), _policy_loader(str(path), cfg))
    raise TargetError(f"{target!r} is not a run directory (no config.yaml), a checkpoint (no manifest.json "
                      "+ policy.safetensors), an HF policy directory (no config.json) or a LoRA adapter "
                      "(no adapter_config.json)")


# ------------------------------------------------------------------------------- output
def _print_failures(report: str, shown: int = 10) -> None:
    """The evaluation's report of failed episodes (timed-out user code), on stderr."""
    lines = report.splitlines()
    more = len(lines) - 1 - shown
    print("saorl eval: " + "\n".join(lines[: shown + 1]) + (f"\n  ... and {more} more" if more > 0 else ""),
          file=sys.stderr)


def format_table(columns: dict[str, dict[str, float]]) -> str:
    """Metric rows × one column per entry of ``columns`` (e.g. ``{"before": m0, "after": m1}``)."""
    lines = [f"{'metric':<20}" + "".join(f"{name:>10}" for name in columns)]
    parts = sorted({k for m in columns.values() for k in m
                    if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2})
    rows = [*_ROWS, *((f"{k[len('eval/'):-len('/accuracy')]} accuracy", k, ".3f") for k in parts)]
    for label, key, fmt in rows:  # a mix's parts: one accuracy row each, after the overall rows
        cells = [format(m[key], fmt) if key in m else "-" for m in columns.values()]
        lines.append(f"{label:<20}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from saorl.agent.render import render_trajectory
    from saorl.errors import StartupError
    from saorl.models.codec import check_vocab, run_tokenizer
    from saorl.runtime.recorder import CountProgress
    from saorl.stages.env_check import prepare_tasks
    from saorl.stages.evaluate import evaluate_config
    from saorl.stages.preflight import check_device, check_env, check_observations, check_tasks

    model = None
    if is_config_file(args.target) and args.overrides and "=" not in args.overrides[0]:
        model, args.overrides = args.overrides[0], args.overrides[1:]
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"saorl eval: expected key=value overrides after the target, got {bad[0]!r}", file=sys.stderr)
        return 2
    if args.tasks is not None and args.tasks < 1:
        print(f"saorl eval: --tasks must be >= 1, got {args.tasks}", file=sys.stderr)
        return 2
    try:
        target = resolve_target(args.target, args.overrides, model)
        factory = check_env(target.cfg)
        prepare_tasks(target.cfg)
        check_device(target.cfg.model.device)
        try:
            tokenizer = run_tokenizer(target.cfg.model)
        except ValueError as e:  # a tokenizer that is not the policy's
            raise TargetError(str(e)) from e
        check_observations(target.cfg, factory, tokenizer)  # before the policy loads
        check_tasks(target.cfg, factory)  # a conversation needs the tokenizer's chat template
        try:
            policy = target.load()
            check_vocab(tokenizer, policy)
        except ValueError as e:
            raise TargetError(str(e)) from e
        if args.temperature is None:
            args.temperature = target.cfg.run.eval_temperature
        with CountProgress(f"eval {args.split}", enabled=target.cfg.run.progress) as count:
            metrics, trajs = evaluate_config(target.cfg, policy, tokenizer, split=args.split, n=args.tasks,
                                             temperature=args.temperature, on_done=count,
                                             on_error=_print_failures)
    except (ConfigError, TargetError, StartupError, FileNotFoundError, NotADirectoryError) as e:
        print(f"saorl eval: {e}" if not isinstance(e, ConfigError) else str(e), file=sys.stderr)
        return 2
    cfg, shown = target.cfg, trajs[: max(0, args.show)]
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    if args.temperature == cfg.run.eval_temperature:
        mode += " (run.eval_temperature)"
    if args.json:
        samples = [render_trajectory(t, tokenizer, color=False) for t in shown]
        print(json.dumps({"policy": target.description, "env": cfg.env.type, "split": args.split,
                          "temperature": args.temperature, **metrics, "samples": samples}, indent=2))
        return 0
    color = sys.stdout.isatty() and not args.no_color
    for t in shown:
        print(render_trajectory(t, tokenizer, color=color))
    print(f"policy  {target.description}")
    episodes = int(metrics.get("eval/episodes", 0))
    print(f"env     {cfg.env.type}, {args.split} split, {episodes} episodes, {mode}")
    print(format_table({"value": metrics}))
    return 0
