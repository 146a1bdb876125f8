"""The tools an episode may call, and where they run: user code under the user-code deadline.

``env.tools: [module.path:function, ...]`` (or an env class's own :attr:`~saorl.envs.base.Env.tools`)
names Python functions written as TRL's ``GRPOTrainer(tools=[...])`` takes them. :class:`Tools` is
what the run's env factory hands every env it makes (``env.toolbox``): the loaded functions (for
their schemas, which the agent loop writes into the prompt: :mod:`saorl.agent.tool_turns`), the
settings of ``env.tool_*``, and :meth:`Tools.call`, which runs one call.

A tool is user code, so with a deadline (``env.call_timeout_s``) each call runs in a warm child
process of a :class:`~saorl.envs.hosted.HostPool`, killed when it runs past the deadline — the same
machinery as a reward function's calls. What a call can go wrong with is never an exception here,
and never the end of the episode: an unknown function, arguments the function cannot be bound to
(``TypeError`` from ``inspect.Signature.bind``), a tool that raises, one killed by the deadline, or
the child dying all come back as an error text that the model reads as the call's result
(:class:`ToolResult` with ``error=True``), and the agent loop counts them (``env/tool_errors``).

A result that is not a string is written as JSON when it can be (a dict, a list, a number), else
with ``str``; TRL writes ``str(result)``, which differs only for dicts and lists (``{'a': 1}``
there, ``{"a": 1}`` here, which is what a model trained on JSON tool results reads best).
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from saorl.envs.hosted import CallTimeout, HostDied, HostPool

ToolFormat = Literal["auto", "hermes", "llama3", "json"]
ToolPrompt = Literal["json", "list"]

__all__ = ["ToolBox", "ToolOptions", "ToolResult", "Tools", "ToolsError", "load_tools"]


class ToolsError(ValueError):
    """``env.tools`` names something that cannot be a tool (not importable, not a function, a name twice)."""


@dataclass(frozen=True)
class ToolOptions:
    """A run's ``env.tool_*`` settings (docs in :class:`saorl.config.sections.EnvConfig`)."""

    specs: tuple[str, ...]
    format: ToolFormat = "auto"
    prompt: ToolPrompt = "json"
    stop: bool = False
    max_turns: int = 4
    max_calls: int = 8


@dataclass(frozen=True)
class ToolResult:
    text: str
    """What the model reads as the call's result."""
    error: bool = False
    """The call did not run to a result: unknown function, bad arguments, raised, killed."""
    timed_out: bool = False
    """It ran past ``call_timeout_s`` and was killed."""


def load_tools(specs: Sequence[str]) -> dict[str, Callable[..., Any]]:
    """The functions named by ``specs`` (``module.path:function``), by their ``__name__`` (the name
    the model calls them by); :class:`ToolsError` naming the spec that is wrong or the name used twice."""
    if isinstance(specs, str) or not specs:
        raise ToolsError(f"env.tools must be a non-empty list of 'module.path:function', got {specs!r}")
    out: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        if not isinstance(spec, str) or ":" not in spec:
            raise ToolsError(f"env.tools: each tool is 'module.path:function', got {spec!r}")
        fn = _import(spec)
        if not callable(fn) or isinstance(fn, type):
            raise ToolsError(f"tool {spec!r} is a {type(fn).__name__}, not a function")
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in out:
            raise ToolsError(f"env.tools: two tools are named {name!r} (the model calls a tool by its "
                             "function's name): rename one")
        out[name] = fn
    return out


def _import(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ToolsError(f"tool {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e} "
                         "(is it on PYTHONPATH, for the rollout workers too?)") from None
    if not hasattr(module, attr):
        raise ToolsError(f"tool {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class ToolBox:
    """Runs calls on the functions of ``specs`` in this process (in a hosted child, the child's)."""

    def __init__(self, specs: Sequence[str]) -> None:
        self.specs = tuple(specs)
        self.functions = load_tools(self.specs)

    def __getstate__(self) -> dict[str, Any]:
        return {"specs": self.specs}  # functions travel by name: a child imports them again

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["specs"])

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        fn = self.functions.get(name)
        if fn is None:
            known = ", ".join(self.functions)
            return ToolResult(f"error: unknown tool {name!r}; the tools are: {known}", True)
        try:
            bound = inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return ToolResult(f"error: bad arguments for {name}: {e}", True)
        try:
            return ToolResult(_text(fn(*bound.args, **bound.kwargs)))
        except Exception as e:
            return ToolResult(f"error: {name} raised {type(e).__name__}: {e}", True)


class Tools:
    """What an env factory gives its envs (``env.toolbox``): the tools, their settings, a runner."""

    def __init__(self, options: ToolOptions, call_timeout_s: float | None) -> None:
        self.options, self.call_timeout_s = options, call_timeout_s
        self.box = ToolBox(options.specs)
        self.pool: HostPool | None = None
        if call_timeout_s is not None:
            self.pool = HostPool(ToolBox, {"specs": list(options.specs)})  # type: ignore[arg-type]

    @property
    def functions(self) -> dict[str, Callable[..., Any]]:
        return self.box.functions

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """The result of one call; every failure is an error result (module docstring)."""
        if self.pool is None:
            return self.box.call(name, arguments)
        site = f"tool {name}({_text(arguments)[:80]})"
        try:
            result, _ = self.pool.call(None, "call", (name, arguments), self.call_timeout_s, site)
        except CallTimeout:
            return ToolResult(f"error: {name} did not return within {self.call_timeout_s:g} s and was "
                              "stopped", True, timed_out=True)
        except HostDied as e:
            return ToolResult(f"error: {name} could not run: {e}", True)
        except BaseException as e:  # raised past ToolBox.call in the child: SystemExit, say
            if isinstance(e, (KeyboardInterrupt, GeneratorExit)):
                raise
            return ToolResult(f"error: {name} raised {type(e).__name__}: {e}", True)
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
