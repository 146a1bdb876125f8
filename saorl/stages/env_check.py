"""The env check every command runs first, before any tensor library is imported: the env type
resolves and its options are ones the env takes (``saorl config`` and ``saorl train`` both run
it, so a typo in ``env.options`` costs a fraction of a second in either). And the making of a
recipe's task files by its ``env.prepare`` command when they are missing
(:func:`prepare_tasks`, which ``saorl train``, ``sft``, ``value_pretrain``, ``eval`` and
``experiment`` run, ``saorl config`` not)."""

from __future__ import annotations

import inspect
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from saorl.config import SaorlConfig
from saorl.envs.registry import (
    BadOptions,
    EnvFactory,
    EnvResolveError,
    MissingExtra,
    env_factory_for,
    resolve_env,
)
from saorl.envs.toolbox import ToolsError
from saorl.errors import StartupError


def check_env(cfg: SaorlConfig) -> EnvFactory:
    """The env factory of ``cfg``, or :class:`StartupError` (module or class missing, bad options)."""
    env = cfg.env
    try:
        cls = resolve_env(env.type)
    except MissingExtra as e:
        raise StartupError(f"env.type: {e}") from None
    except EnvResolveError as e:
        raise StartupError(f"env.type: {e}. A custom env is 'module.path:ClassName' with the "
                           "module importable from here (installed, or on PYTHONPATH); built-ins are listed "
                           "by saorl envs list") from None
    try:
        factory = env_factory_for(env, deadline=False)
    except ToolsError as e:
        raise StartupError(f"env.tools: {e}") from None
    except MissingExtra as e:
        raise StartupError(f"env.type: {e}") from None
    except EnvResolveError as e:  # the class's observation format
        raise StartupError(f"{e}. Set env.observation_format / env.observation_role, or fix the class "
                           "attribute") from None
    except (BadOptions, TypeError, ValueError) as e:
        if env.type == "mix":  # a part's problem, named by its index
            raise StartupError(f"env.mix: {str(e).removeprefix('env ' + repr('mix') + ': ')}") from None
        if not isinstance(e, (BadOptions, TypeError)):  # a value the class refused (a reward function
            raise StartupError(f"env.options: {e}") from None  # that does not import): its own message
        raise StartupError(f"env.options: {e}. {_accepted_options(cls)}") from None
    if factory.tools is not None:
        from saorl.agent.tool_turns import tool_schemas
        from saorl.envs.tool_calls import ToolSchemaError  # the tensor-free agent modules

        try:
            tool_schemas(factory.tools.functions)
        except ToolSchemaError as e:
            factory.close()
            raise StartupError(f"env.tools: {e}") from None
    return factory


def option_params(cls: type) -> list[inspect.Parameter]:
    """The env class's options: the named parameters of its ``__init__`` (``self`` left out)."""
    return [p for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _accepted_options(cls: type) -> str:
    params = option_params(cls)
    if not params:
        return f"{cls.__name__} takes no options: remove env.options"
    names = ", ".join(p.name if p.default is p.empty else f"{p.name} (default {p.default!r})" for p in params)
    return f"{cls.__name__} accepts: {names}; set them as env.options.NAME=VALUE"


def missing_task_files(cfg: SaorlConfig) -> list[tuple[str, str]]:
    """``(setting, path)`` of each task file or dataset directory ``cfg.env`` names that is missing."""
    env = cfg.env
    named = [("env.tasks_file", env.tasks_file), ("env.test_tasks_file", env.test_tasks_file),
             ("env.dataset.path", env.dataset.path if env.dataset is not None else None)]
    return [(key, path) for key, path in named if path and not Path(path).expanduser().exists()]


PREPARE_TIMEOUT_S = 3600.0
"""How long ``env.prepare`` may run (and a torchrun rank other than 0 waits for its files)."""


def prepare_tasks(cfg: SaorlConfig, log=None) -> None:
    """Run ``env.prepare`` when a task file it makes is missing (see its field's docstring);
    :class:`StartupError` when it fails or leaves one missing. Nothing when every file is there or
    no command is set (the task check then names the missing file). Under torchrun only rank 0
    runs it; the other ranks wait for its files (rank 0 failing stops them all)."""
    missing = missing_task_files(cfg)
    command = cfg.env.prepare
    if not missing or not command:
        return
    log = log or (lambda text: print(f"saorl: {text}", file=sys.stderr, flush=True))
    if int(os.environ.get("RANK", "0")) != 0:  # the same test as saorl train's rank0
        deadline = time.monotonic() + PREPARE_TIMEOUT_S
        while missing_task_files(cfg):
            if time.monotonic() > deadline:
                raise StartupError(f"{missing[0][0]} {missing[0][1]} is missing, and rank 0's env.prepare, "
                                   f"`{command}`, did not make it in {PREPARE_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        return
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    key, path = missing[0]
    log(f"{key} {path} is missing: making the task files with `{command}` (env.prepare, once)")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StartupError(f"{key} {path} is missing, and env.prepare, `{command}`, which makes it, could "
                           f"not run: {e}. Run it by hand from the directory you train in, or fix "
                           "env.prepare") from None
    said = [line.strip() for line in f"{done.stdout}\n{done.stderr}".splitlines() if line.strip()]
    tail = said[-1][-300:] if said else ""  # its last line: the error (no traceback), or what it wrote
    if done.returncode != 0:
        raise StartupError(f"{key} {path} is missing, and env.prepare, `{command}`, which makes it, failed "
                           f"(exit {done.returncode}) in {Path.cwd()}: {tail}. It runs in the current "
                           "directory (a recipe's command from the repository's root); fix what it says, "
                           "or make the files by hand")
    left = missing_task_files(cfg)
    if left:
        raise StartupError(f"env.prepare, `{command}`, ran but {left[0][0]} {left[0][1]} is still missing "
                           f"(it said: {tail or 'nothing'}); make env.prepare write the file the config "
                           "names")
    if tail:
        log(tail)
