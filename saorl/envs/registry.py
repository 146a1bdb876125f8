"""Names for environments: built-ins by short name, anything else by ``"module.path:ClassName"``.

``resolve_env`` imports lazily, so listing the built-ins costs nothing and a broken third-party
env only fails when it is asked for. ``make_env_factory`` builds one instance up front so that a
bad option fails at config time, with the option's name, not inside a rollout worker.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from saorl.envs.base import Env

BUILTIN_ENVS: dict[str, str] = {
    "math_tool": "saorl.envs.math_tool:MathToolEnv",
    "code_repair": "saorl.envs.code_repair:CodeRepairEnv",
    "style_shift": "saorl.envs.style_shift:StyleShiftEnv",
    "synthetic": "saorl.envs.synthetic:SyntheticLengthEnv",
}


class EnvResolveError(ValueError):
    """An env type string that names no usable Env subclass."""


def resolve_env(type_str: str) -> type[Env]:
    """The Env class for a built-in name (``"math_tool"``) or a ``"module.path:ClassName"``."""
    if not isinstance(type_str, str) or not type_str.strip():
        raise EnvResolveError(f"env type must be a non-empty string, got {type_str!r}")
    target = BUILTIN_ENVS.get(type_str, type_str)
    if ":" not in target:
        raise EnvResolveError(
            f"unknown env {type_str!r}: not a built-in ({', '.join(sorted(BUILTIN_ENVS))}) "
            "and not of the form 'module.path:ClassName'"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise EnvResolveError(f"env {type_str!r}: cannot import module {module_name!r}: {e}") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise EnvResolveError(f"env {type_str!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise EnvResolveError(f"env {type_str!r}: {target} is not a subclass of saorl.envs.base.Env")
    return cls


def make_env_factory(type_str: str, options: Mapping[str, Any] | None = None) -> Callable[[], Env]:
    """A zero-argument callable that builds a fresh env with ``options``.

    One instance is built here to validate the options: an unknown option or a bad value raises
    ``ValueError`` naming the env and the option.
    """
    cls = resolve_env(type_str)
    opts = dict(options or {})
    try:
        cls(**opts)
    except TypeError as e:
        raise ValueError(f"env {type_str!r}: bad options {opts}: {e}") from e
    except ValueError as e:
        raise ValueError(f"env {type_str!r}: {e}") from e

    def factory() -> Env:
        return cls(**opts)

    return factory
