"""Native tool calls, the pure part: a model's calls parsed out of its text, a function's schema.

Pure: no engine, no env, no I/O. The agent loop (:mod:`saorl.agent.tool_turns`) and the OpenAI
API proxy both read model output through :func:`parse_tool_calls` and describe Python functions
through :func:`function_schema`.

**Formats** (:data:`TOOL_CALL_FORMATS`), the way a family of models writes a call:

- ``hermes`` — Hermes, Qwen2/2.5/3 and the system-prompt format saorl writes for a template
  without tools support (:mod:`saorl.envs.tool_prompt`): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; several may follow each other.
- ``llama3`` — Llama 3.1/3.2/3.3 with custom tools: the reply is a JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` is taken too), optionally after
  ``<|python_tag|>``; several are separated by ``;``.
- ``json`` — the fallback for a model that has no format of its own: every top-level JSON object
  in the reply that has a ``"name"`` and ``"arguments"`` (or ``"parameters"``) is a call.

JSON is read with :meth:`json.JSONDecoder.raw_decode`, so a string argument may hold anything —
``</tool_call>``, braces, newlines — and nested objects parse whole. ``arguments`` may also be a
JSON string holding the object (as the OpenAI API sends it). What cannot be a call is an error line
in :attr:`ParsedTurn.errors`, never an exception: a ``<tool_call>`` block whose body is not JSON,
a call without a string ``name``, arguments that are not an object, JSON nested past Python's
recursion limit or holding an int past its digit limit. In ``llama3`` and ``json`` a ``{`` that
does not decode is text unless a ``"name"`` key follows it closely, in which case it was meant as
a call and is an error; when failed decodes have read more than :data:`_SCAN_BUDGET` characters
in all, the rest of the reply is text and an error line says so.

**Schemas** (:func:`function_schema`) are what TRL's ``GRPOTrainer(tools=[...])`` makes of a
function: transformers' ``get_json_schema`` — every argument type-hinted, a Google-style
docstring whose ``Args:`` section describes each one — giving
``{"type": "function", "function": {"name", "description", "parameters", ...}}``.
:func:`argument_errors` checks a call's arguments against such a schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TOOL_CALL_FORMATS", "ParsedTurn", "ToolCall", "ToolSchemaError", "argument_errors",
           "function_schema", "parse_tool_calls", "tool_stop_strings"]

TOOL_CALL_FORMATS: tuple[str, ...] = ("hermes", "llama3", "json")
"""The call formats :func:`parse_tool_calls` reads (module docstring)."""

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_NAME_NEAR = re.compile(r'\s*"name"\s*:')
_DECODER = json.JSONDecoder()
_JSON_ERRORS = (ValueError, RecursionError)
"""What decoding a model's JSON may raise: bad JSON (:class:`json.JSONDecodeError` is a ValueError),
an int past Python's digit limit (ValueError), nesting past the recursion limit (RecursionError)."""


_SCAN_BUDGET = 100_000_000
"""Characters that failed decodes in ``llama3`` and ``json`` may look at, all together (about 0.1 s),
before the rest of a reply is read as text: each ``{`` that does not decode is retried one
character on, so a hostile reply (thousands of ``{`` in an unterminated string, or nested past the
recursion limit) would otherwise cost time quadratic in its length."""


def _cost(e: Exception, text: str, start: int) -> int:
    """About how many characters a decode from ``start`` that failed with ``e`` looked at: the
    scan to where it failed (an unterminated string, a too-deep nesting: maybe the whole rest), and
    :class:`json.JSONDecodeError`'s line count over the text before that."""
    pos = getattr(e, "pos", None)
    if pos is None or getattr(e, "msg", "").startswith("Unterminated string"):
        return 2 * len(text) - start
    return 2 * pos - start


def _why(e: Exception) -> str:
    """The reason a decode failed, one short phrase."""
    if isinstance(e, RecursionError):
        return "nested too deep"
    return getattr(e, "msg", None) or str(e).split(":")[0]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    """The parsed JSON object of arguments."""
    id: str
    """The model's own id for the call, else ``call_<n>``: its position among the turn's calls."""

    def message_call(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` entry (the form chat templates and TRL's
        completions take: ``arguments`` a dict; the OpenAI API sends it as a JSON string)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The text outside the calls (their markup removed), stripped."""
    calls: list[ToolCall]
    errors: list[str]
    """One line per malformed call: bad JSON, no name, arguments not an object."""


class ToolSchemaError(ValueError):
    """A function that cannot be offered as a tool (no type hints, no docstring, not a function)."""


def _preview(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[:n] + "...")


def _as_call(obj: Any, index: int, where: str) -> ToolCall | str:
    """A decoded JSON value as a call, or the error line saying why it is not one."""
    if not isinstance(obj, dict):
        return f"{where}: a call must be a JSON object with a name and arguments, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where}: the call has no function name (a string \"name\"; keys: {sorted(obj)})"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # the OpenAI API's form: the object as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except _JSON_ERRORS as e:
            return f"{where}: the arguments of {name!r} are a string that is not JSON ({_why(e)})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"{where}: the arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    call_id = obj.get("id")
    return ToolCall(name.strip(), args, call_id if isinstance(call_id, str) and call_id else f"call_{index}")


def _skip_block(text: str, start: int, why: str, n: int, errors: list[str]) -> int:
    """Record the ``n``-th ``<tool_call>`` block as an error (``why``, then the text from ``start`` to
    the block's close) and return where reading goes on: after its ``</tool_call>``, or the end."""
    close = text.find(HERMES_CLOSE, start)
    stop = len(text) if close < 0 else close + len(HERMES_CLOSE)
    errors.append(f"<tool_call> {n}: {why}: {_preview(text[start:stop])}")
    return stop


def _parse_hermes(text: str) -> tuple[list[str], list[Any], list[str]]:
    """(text pieces outside the calls, decoded call bodies in order, errors)."""
    pieces, bodies, errors = [], [], []
    pos = 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        pieces.append(text[pos:start])
        body = start + len(HERMES_OPEN)
        at = len(text) - len(text[body:].lstrip())
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except _JSON_ERRORS as e:
            pos = _skip_block(text, body, f"not JSON ({_why(e)})", len(bodies) + len(errors) + 1, errors)
            continue
        rest = len(text) - len(text[end:].lstrip())
        if text.startswith(HERMES_CLOSE, rest):
            pos = rest + len(HERMES_CLOSE)
        elif rest == len(text):  # the reply ended inside the block: the call is whole
            pos = rest
        else:
            pos = _skip_block(text, end, "text after the JSON object before </tool_call>",
                              len(bodies) + len(errors) + 1, errors)
            continue
        bodies.append(obj)
    pieces.append(text[pos:])
    return pieces, bodies, errors


def _parse_objects(text: str, separators: str = "") -> tuple[list[str], list[Any], list[str]]:
    """Top-level JSON objects that look like calls (a ``name`` and arguments), for ``llama3`` and ``json``."""
    pieces, bodies, errors = [], [], []
    pos = scan = spent = 0
    while (start := text.find("{", scan)) >= 0:
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except _JSON_ERRORS as e:
            if _NAME_NEAR.match(text, start + 1):
                errors.append(f"a JSON call that does not parse ({_why(e)}): {_preview(text[start:])}")
                pieces.append(text[pos:start])
                pos = scan = len(text)
                break
            spent += _cost(e, text, start)
            if spent > _SCAN_BUDGET:
                errors.append(f"the reply was not searched for calls past character {start}: the "
                              "text there is too much JSON that does not parse")
                break
            scan = start + 1
            continue
        if isinstance(obj, dict) and "name" in obj and ("arguments" in obj or "parameters" in obj):
            pieces.append(text[pos:start])
            bodies.append(obj)
            pos = end
            if separators:  # ';' between llama3 calls is markup, not text
                while pos < len(text) and (text[pos] in separators or text[pos].isspace()):
                    pos += 1
        scan = end
    pieces.append(text[pos:])
    return pieces, bodies, errors


def parse_tool_calls(text: str, fmt: str) -> ParsedTurn:
    """The calls in ``text`` (a model's reply) written in format ``fmt`` (module docstring)."""
    if fmt == "hermes":
        pieces, bodies, errors = _parse_hermes(text)
    elif fmt == "llama3":
        pieces, bodies, errors = _parse_objects(text.replace(PYTHON_TAG, ""), separators=";")
    elif fmt == "json":
        pieces, bodies, errors = _parse_objects(text)
    else:
        raise ValueError(f"unknown tool call format {fmt!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
    calls: list[ToolCall] = []
    for k, body in enumerate(bodies, 1):
        got = _as_call(body, len(calls), f"call {k}")
        if isinstance(got, str):
            errors.append(got)
        else:
            calls.append(got)
    return ParsedTurn("".join(pieces).strip(), calls, errors)


def tool_stop_strings(fmt: str) -> tuple[str, ...]:
    """Strings that end a call in ``fmt``, for a run that ends the model's turn at its first call
    (``env.tool_stop``): ``</tool_call>`` for ``hermes``; none for ``llama3`` and ``json``, whose
    calls end with the turn (the eos)."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; known: {', '.join(TOOL_CALL_FORMATS)}")
    return (HERMES_CLOSE,) if fmt == "hermes" else ()


def _name(fn: Any) -> str:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qual}" if module and qual else repr(fn)


def function_schema(fn: Callable) -> dict:
    """The tool schema of ``fn``, as TRL's ``tools=`` makes it (transformers' ``get_json_schema``):
    ``{"type": "function", "function": {"name", "description", "parameters"}}``.
    :class:`ToolSchemaError`, one paragraph naming the function, when it cannot be one."""
    from transformers.utils import get_json_schema

    if not callable(fn) or isinstance(fn, type):
        raise ToolSchemaError(f"tool {fn!r} is a {type(fn).__name__}, not a function: a tool is a Python "
                              "function with type-hinted arguments and a Google-style docstring")
    try:
        schema = get_json_schema(fn)
    except Exception as e:
        raise ToolSchemaError(
            f"tool {_name(fn)} cannot be offered to the model: {e} A tool is described to the model by its "
            "JSON schema, made as TRL makes it (transformers.utils.get_json_schema): every argument needs a "
            "type hint (int, float, str, bool, list[...], dict[...], Literal[...], Optional), and the "
            "docstring a description line and an 'Args:' section with one 'name: description' line per "
            "argument (Google style).") from None
    return schema


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def _type_ok(value: Any, spec: dict[str, Any]) -> bool:
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        types = _JSON_TYPES.get(kind)
        if types is None:
            return True  # a type this check does not know: the tool decides
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue
        if isinstance(value, types):
            return "enum" not in spec or value in spec["enum"]
    return False


def argument_errors(schema: dict, arguments: dict[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for a tool of ``schema`` (:func:`function_schema`'s form):
    a required argument missing, one the function does not take, a value of the wrong JSON type
    or outside its ``enum``. Empty when they fit."""
    params = schema.get("function", schema).get("parameters") or {}
    props: dict[str, Any] = params.get("properties") or {}
    out = [f"missing required argument {k!r}" for k in params.get("required", ()) if k not in arguments]
    for key, value in arguments.items():
        if key not in props:
            out.append(f"unexpected argument {key!r} (it takes: {', '.join(props) or 'none'})")
        elif not _type_ok(value, props[key]):
            want = props[key].get("type")
            extra = f" in {props[key]['enum']}" if "enum" in props[key] else ""
            out.append(f"argument {key!r} must be {want}{extra}, got {json.dumps(value)[:40]}")
    return out
