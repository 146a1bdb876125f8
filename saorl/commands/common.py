"""What every command shares: reading ``[CONFIG] [key=value ...]``, failing with one paragraph, and
the exit status of an error that reaches the command line (see :mod:`saorl.errors`)."""

from __future__ import annotations

import sys
from typing import NoReturn

from saorl.config import ConfigError, SaorlConfig, load_config

EXIT_BUG, EXIT_USER, EXIT_RUN_FAILED, EXIT_INTERRUPTED = 1, 2, 3, 130
"""Exit statuses: an unexpected error (a bug); a problem with the input, found before anything ran;
a run that started and failed; Ctrl-C."""


def exit_status(error: BaseException, prog: str, debug: bool = False) -> tuple[int, str]:
    """The exit status and the one-paragraph message for ``error``, raised out of command ``prog``."""
    from saorl.data.tasks import TaskFileError
    from saorl.envs.registry import EnvResolveError
    from saorl.errors import RunFailure, StartupError
    from saorl.experiments.spec import SpecError

    # one paragraph: an error that carries a worker's traceback in its text is cut before it
    text = " ".join(str(error).split("Traceback (most recent call last)")[0].split())
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, f"{prog}: interrupted"
    if isinstance(error, ConfigError):
        return EXIT_USER, text  # it names the file already: "config error in PATH: ..."
    if isinstance(error, (StartupError, TaskFileError, EnvResolveError, SpecError)):
        return EXIT_USER, f"{prog}: {text}"
    if isinstance(error, RunFailure):
        return EXIT_RUN_FAILED, f"{prog}: the run failed: {text}"
    if _out_of_memory(error):
        return EXIT_RUN_FAILED, (
            f"{prog}: the run failed: this machine ran out of memory ({type(error).__name__}: {text}). "
            "Ray's memory monitor kills a process when the node's memory use passes its threshold "
            "(RAY_memory_usage_threshold, 0.95). What was trained up to the last checkpoint is kept: free "
            "memory (other jobs, fewer rollout.num_workers or rollout.engine.slots, a smaller "
            "trainer.batch_size), then continue with saorl train --resume RUN_DIR.")
    hint = "" if debug else " Rerun with --debug (or SAORL_DEBUG=1) to see the traceback."
    return EXIT_BUG, (f"{prog}: unexpected error: {type(error).__name__}: {text}. This is a bug in saorl or "
                      f"in code it runs (an env, a reward function); please report it.{hint}")


def _out_of_memory(error: BaseException) -> bool:
    """Ray's memory monitor killed a process of the run (``ray.exceptions.OutOfMemoryError``: a
    resource problem, exit 3, not a bug); Ray is looked up only where the run imported it."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    oom = getattr(ray_exceptions, "OutOfMemoryError", None)
    return oom is not None and isinstance(error, oom)


def fail(message: str, code: int = EXIT_USER) -> NoReturn:
    """Print ``message`` (one paragraph) to stderr and exit with ``code`` (2: a user error)."""
    print(message, file=sys.stderr)
    raise SystemExit(code)


def split_config_args(prog: str, items: list[str]) -> tuple[str | None, list[str]]:
    """The first argument without '=' is the config file; the rest are ``key=value`` overrides."""
    if items and "=" not in items[0]:
        path, rest = items[0], items[1:]
    else:
        path, rest = None, list(items)
    bad = [a for a in rest if "=" not in a]
    if bad:
        fail(f"{prog}: expected key=value overrides after the config, got {bad[0]!r}")
    return path, rest


def config_or_exit(prog: str, items: list[str]) -> SaorlConfig:
    """The config named by ``items`` (``[CONFIG] [key=value ...]``), or exit 2 with the reason."""
    path, overrides = split_config_args(prog, items)
    return load_file_or_exit(path, overrides)


def load_file_or_exit(path: str | None, overrides: list[str]) -> SaorlConfig:
    """:func:`~saorl.config.load_config`, or exit 2 with its one-paragraph error."""
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        fail(str(e))


def check_env_or_exit(prog: str, cfg: SaorlConfig) -> None:
    """The env's type resolves and takes the options given, checked with no tensor library
    imported (:mod:`saorl.stages.env_check`); else its :class:`~saorl.errors.StartupError`, which
    the command line reports as one paragraph, exit 2 (with ``--debug``, its traceback too)."""
    from saorl.stages.env_check import check_env

    del prog  # the command line names the command
    check_env(cfg)
