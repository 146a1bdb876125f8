"""The env check every command runs first, before any tensor library is imported: the env type
resolves and its options are ones the env takes (``saorl config`` and ``saorl train`` both run
it, so a typo in ``env.options`` costs a fraction of a second in either)."""

from __future__ import annotations

import inspect

from saorl.config import SaorlConfig
from saorl.envs.registry import EnvFactory, EnvResolveError, MissingExtra, env_factory_for, resolve_env
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
        return env_factory_for(env, deadline=False)
    except MissingExtra as e:
        raise StartupError(f"env.type: {e}") from None
    except EnvResolveError as e:  # the class's observation format
        raise StartupError(f"{e}. Set env.observation_format / env.observation_role, or fix the class "
                           "attribute") from None
    except (ValueError, TypeError) as e:
        if env.type == "mix":  # a part's problem, named by its index
            raise StartupError(f"env.mix: {str(e).removeprefix('env ' + repr('mix') + ': ')}") from None
        raise StartupError(f"env.options: {e}. {_accepted_options(cls)}") from None


def _accepted_options(cls: type) -> str:
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not params:
        return f"{cls.__name__} takes no options: remove env.options"
    names = ", ".join(p.name if p.default is p.empty else f"{p.name} (default {p.default!r})" for p in params)
    return f"{cls.__name__} accepts: {names}; set them as env.options.NAME=VALUE"
