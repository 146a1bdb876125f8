"""Names for environments: built-ins by short name, anything else by ``"module.path:ClassName"``.

``resolve_env`` imports lazily, so listing the built-ins costs nothing and a broken third-party
env only fails when it is asked for. ``make_env_factory`` builds one instance up front so that a
bad option fails at config time, with the option's name, not inside a rollout worker; given a
deadline, the envs it makes for an env that runs user code (:func:`runs_user_code`) are
:class:`~saorl.envs.hosted.HostedEnv` s, whose calls run in child processes under it. The run's
``env.observation_format`` / ``env.observation_role``, when set, override the env class's own on
every env it makes (the agent loop reads them off the env). :func:`env_factory_for` builds the
factory of a run's ``env`` config section.

Tools (``env.tools``, or the env class's own :attr:`~saorl.envs.base.Env.tools`): the factory
loads them once into a :class:`~saorl.envs.toolbox.Tools` (their calls under ``call_timeout_s``,
in child processes of their own) and gives it to every env it makes as ``env.toolbox``; such an
env's ``max_turns`` becomes ``env.tool_max_turns`` and its observations are chat turns (role
``tool``) unless ``env.observation_format`` / ``env.observation_role`` say otherwise.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from saorl.envs.base import OBSERVATION_FORMATS, OBSERVATION_ROLES, Env
from saorl.envs.extras import missing_extra
from saorl.envs.hosted import HostedEnv, HostPool
from saorl.envs.toolbox import ToolOptions, Tools

BUILTIN_ENVS: dict[str, str] = {
    "math_tool": "saorl.envs.math_tool:MathToolEnv",
    "math_levels": "saorl.envs.math_levels:MathLevelsEnv",
    "code_repair": "saorl.envs.code_repair:CodeRepairEnv",
    "style_shift": "saorl.envs.style_shift:StyleShiftEnv",
    "synthetic": "saorl.envs.synthetic:SyntheticLengthEnv",
    "noisy_lookup": "saorl.envs.noisy_lookup:NoisyLookupEnv",
    "prompt_reward": "saorl.envs.prompt_reward:PromptRewardEnv",
    "openai_agent": "saorl.envs.openai_agent:OpenAIAgentEnv",
    "reasoning_gym": "saorl.envs.reasoning_gym_env:ReasoningGymEnv",
    "textarena": "saorl.envs.textarena_env:TextArenaEnv",
    "openenv": "saorl.envs.openenv_env:OpenEnvEnv",
    "bfcl": "saorl.envs.bfcl_env:BfclEnv",
    "mix": "saorl.envs.mix:MixEnv",
}


class EnvResolveError(ValueError):
    """An env type string that names no usable Env subclass."""


class BadOptions(ValueError):
    """Options the env class does not take (its ``__init__`` raised TypeError on them)."""


class ModuleMissing(EnvResolveError):
    """``module.path:name`` whose module does not exist here (a typo, or not on ``sys.path``)."""


class AttributeMissing(EnvResolveError):
    """``module.path:name`` whose module imports but has no ``name``."""


class MissingExtra(EnvResolveError):
    """An env whose optional package is not installed; the message names the extra to install."""


def import_object(spec: str, what: str) -> Any:
    """The attribute named by ``"module.path:name"``; an ``EnvResolveError`` that starts with ``what``
    and says which part failed: not of that form, :class:`ModuleMissing` (no such module: a typo,
    or not on ``sys.path``), the module raised while importing, :class:`AttributeMissing` (the
    module has no such name). A missing name gets the close ones as "did you mean"."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EnvResolveError(f"{what}: expected 'module.path:name', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ModuleMissing(f"{what}: no module named {e.name!r}{_close_modules(e.name)}") from e
        raise EnvResolveError(f"{what}: importing module {module_name!r} failed: {type(e).__name__}: "
                              f"{e}") from e  # a module that exists and imports one that does not
    except Exception as e:
        raise EnvResolveError(f"{what}: importing module {module_name!r} raised {type(e).__name__}: "
                              f"{e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        public = [n for n in dir(module) if not n.startswith("_")]
        raise AttributeMissing(f"{what}: module {module_name!r} has no attribute {attr!r}"
                               f"{_did_you_mean(attr, public)}")
    return obj


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _close_modules(name: str) -> str:
    """"did you mean" among the modules beside ``name`` (in its parent package, or top-level)."""
    parent, _, leaf = name.rpartition(".")
    try:
        path = importlib.import_module(parent).__path__ if parent else None
    except Exception:  # the parent is missing too, or not a package
        return ""
    siblings = [m.name for m in pkgutil.iter_modules(path)]
    close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.75)
    prefix = f"{parent}." if parent else ""
    return f" (did you mean {' or '.join(repr(prefix + c) for c in close)}?)" if close else ""


def resolve_env(type_str: str) -> type[Env]:
    """The Env class for a built-in name (``"math_tool"``) or a ``"module.path:ClassName"``;
    :class:`MissingExtra` when the packages of its ``requires`` are not installed."""
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
    problem = missing_extra(type_str, cls.requires)
    if problem:
        raise MissingExtra(problem)
    return cls


def env_version_key(type_str: str) -> dict[str, int]:
    """The env's part of a cache key: ``{"env_version": v}``, empty at version 1 (so the keys of
    caches built before envs had versions stay valid)."""
    version = resolve_env(type_str).version
    return {} if version == 1 else {"env_version": version}


def runs_user_code(cls: type[Env]) -> bool:
    """Whether ``cls``'s ``reset`` / ``step`` run code saorl does not ship: a class from outside the
    saorl package, or a built-in that calls user code (``Env.calls_user_code``: ``prompt_reward``)."""
    return cls.calls_user_code or not cls.__module__.startswith("saorl.")


class EnvFactory:
    """Builds a fresh env per call (``factory()``); :meth:`close` ends the child processes that
    the hosted envs of this factory share (also as a context manager)."""

    def __init__(self, cls: type[Env], options: dict[str, Any], template: Env,
                 call_timeout_s: float | None, observation: dict[str, str] | None = None,
                 tool_options: ToolOptions | None = None) -> None:
        self.cls, self.options, self.call_timeout_s = cls, options, call_timeout_s
        self.overrides: dict[str, Any] = dict(observation or {})
        """The overrides of the env's ``observation_format`` / ``observation_role`` (and, with
        tools, ``tools`` and ``max_turns``)."""
        self.tools: Tools | None = None
        """The tools the envs of this factory offer the model (None: none)."""
        given = tool_options is not None and tool_options.specs
        specs = tuple(tool_options.specs) if given else template.tools  # type: ignore[union-attr]
        if specs:
            opts = tool_options or ToolOptions(specs)
            self.tools = Tools(ToolOptions(tuple(specs), opts.format, opts.prompt, opts.stop, opts.max_turns,
                                           opts.max_calls), call_timeout_s)
            self.overrides = {"observation_format": "chat", **self.overrides, "tools": tuple(specs),
                              "max_turns": opts.max_turns}
        self.template = self._stamp(template)
        self.pool: HostPool | None = None
        if call_timeout_s is not None and runs_user_code(cls):
            self.pool = HostPool(cls, options)

    def _stamp(self, env: Env) -> Env:
        for name, value in self.overrides.items():
            setattr(env, name, value)
        env.call_timeout_s = self.call_timeout_s
        if self.tools is not None:
            env.toolbox = self.tools
        return env

    @property
    def observation(self) -> tuple[str, str]:
        """``(format, role)`` of the observations of the envs this factory makes."""
        return self.template.observation_format, self.template.observation_role

    def __call__(self) -> Env:
        if self.pool is None:
            return self._stamp(self.cls(**self.options))
        return self._stamp(HostedEnv(self.template, self.pool, self.call_timeout_s))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.tools is not None:
            self.tools.close()

    def __enter__(self) -> EnvFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_env_factory(type_str: str, options: Mapping[str, Any] | None = None, *,
                     call_timeout_s: float | None = None, observation_format: str | None = None,
                     observation_role: str | None = None,
                     tool_options: ToolOptions | None = None) -> EnvFactory:
    """A zero-argument callable that builds a fresh env with ``options``.

    One instance is built here to validate the options: an unknown option or a bad value raises
    ``ValueError`` naming the env and the option. With ``call_timeout_s`` (the run's
    ``env.call_timeout_s``) an env that runs user code has its ``reset`` and ``step`` run in warm
    child processes that are killed past that many seconds (:mod:`saorl.envs.hosted`); close the
    factory when done with it. Without, every env runs in the caller's process.
    ``observation_format`` / ``observation_role`` (None: the env class's own) are set on every env
    it makes; values the agent loop does not know (an env class's own) are an :class:`EnvResolveError`.
    ``tool_options`` (the run's ``env.tool*``) give the envs tools (module docstring); a tool that
    cannot be imported is a ``ValueError`` naming it.
    """
    cls = resolve_env(type_str)
    observation = {k: v for k, v in (("observation_format", observation_format),
                                     ("observation_role", observation_role)) if v is not None}
    for name, allowed in (("observation_format", OBSERVATION_FORMATS),
                          ("observation_role", OBSERVATION_ROLES)):
        value = observation.get(name, getattr(cls, name))
        if value not in allowed:
            raise EnvResolveError(f"env {type_str!r}: {name} must be one of {list(allowed)}, got {value!r} "
                                  f"(env.{name}, or the class attribute {cls.__qualname__}.{name})")
    opts = dict(options or {})
    try:
        template = cls(**opts)
    except MissingExtra:
        raise
    except TypeError as e:
        raise BadOptions(f"env {type_str!r}: bad options {opts}: {e}") from e
    except ValueError as e:
        raise ValueError(f"env {type_str!r}: {e}") from e
    return EnvFactory(cls, opts, template, call_timeout_s, observation, tool_options)


def tool_options_for(env: Any) -> ToolOptions:
    """The ``env.tool*`` settings of a run's ``env`` config section (``specs`` empty: the env
    class's own tools, if any)."""
    return ToolOptions(tuple(env.tools), env.tool_format, env.tool_prompt, env.tool_stop, env.tool_max_turns,
                       env.tool_max_calls)


def env_factory_for(env: Any, *, deadline: bool = True) -> EnvFactory:
    """The factory of a run's ``env`` config section: its type, options (a mix's parts), observation
    format, tools and (with ``deadline``) ``call_timeout_s``."""
    return make_env_factory(env.type, env.env_options,
                            call_timeout_s=env.call_timeout_s if deadline else None,
                            observation_format=env.observation_format,
                            observation_role=env.observation_role, tool_options=tool_options_for(env))
