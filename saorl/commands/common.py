"""What every command shares: reading ``[CONFIG] [key=value ...]`` and failing with one paragraph."""

from __future__ import annotations

import sys
from typing import NoReturn

from saorl.config import ConfigError, SaorlConfig, load_config


def fail(message: str, code: int = 2) -> NoReturn:
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
