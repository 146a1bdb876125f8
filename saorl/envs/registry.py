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
    "math_levels": "saorl.envs.math_levels:MathLevelsEnv",
    "code_repair": "saorl.envs.code_repair:CodeRepairEnv",
    "style_shift": "saorl.envs.style_shift:StyleShiftEnv",
    "synthetic": "saorl.envs.synthetic:SyntheticLengthEnv",
    "noisy_lookup": "saorl.envs.noisy_lookup:NoisyLookupEnv",
    "prompt_reward": "saorl.envs.prompt_reward:PromptRewardEnv",
}


class EnvResolveError(ValueError):
    """An env type string that names no usable Env subclass."""


def import_object(spec: str, what: str) -> Any:
    """The attribute named by ``"module.path:name"``; ``EnvResolveError`` that starts with ``what``
    and says which part failed (not of that form, module not importable, no such attribute)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EnvResolveError(f"{what}: expected 'module.path:name', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise EnvResolveError(f"{what}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise EnvResolveError(f"{what}: module {module_name!r} has no attribute {attr!r}")
    return obj


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
    cls = import_object(target, f"env {type_str!r}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise EnvResolveError(f"env {type_str!r}: {target} is not a subclass of saorl.envs.base.Env")
    return cls


def env_version_key(type_str: str) -> dict[str, int]:
    """The env's part of a cache key: ``{"env_version": v}``, empty at version 1 (so the keys of
    caches built before envs had versions stay valid)."""
    version = resolve_env(type_str).version
    return {} if version == 1 else {"env_version": version}


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
