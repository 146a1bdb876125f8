"""How the tools' schemas reach the model: through its chat template, or a system prompt saorl writes.

A template *supports tools* when its source reads the ``tools`` variable that
``apply_chat_template(..., tools=...)`` sets (Qwen2/2.5/3, Hermes, Llama 3.1+, Mistral's recent
ones): then the schemas go to it as they are and it writes them where the model was trained to
read them. A template that never reads it (SmolLM2's, a plain ChatML one) would drop them
silently, so saorl writes them itself, into the system message (:func:`with_tool_system_prompt`):
after the conversation's own system message, or as the first message when there is none. Two
styles (``env.tool_prompt``):

- ``json`` (default): Qwen2.5's own tool prompt, word for word — the schemas as JSON lines inside
  ``<tools></tools>`` and the instruction to answer with ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`` — the most common format in open tool-calling data;
- ``list``: one line per tool, ``name(arg: type, ...): description``, and a one-line example call.

Either way the model is asked for the ``hermes`` call format, which is what :func:`call_format`
picks for such a template under ``env.tool_format: auto``. For a template that supports tools, the
format is read off the template: ``<tool_call>`` in it means ``hermes``, ``<|python_tag|>`` or an
``ipython`` role ``llama3``, anything else the plain ``json`` fallback.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOLS_VARIABLE = re.compile(r"\btools\b")

JSON_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
JSON_FOOTER = ("</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_EXAMPLE = {"hermes": '<tool_call>{{"name": "{name}", "arguments": {{{args}}}}}</tool_call>',
            "llama3": '{{"name": "{name}", "parameters": {{{args}}}}}',
            "json": '{{"name": "{name}", "arguments": {{{args}}}}}'}


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template's source reads ``tools`` (module docstring)."""
    return bool(template) and TOOLS_VARIABLE.search(template) is not None


def call_format(template: str | None, setting: str = "auto") -> str:
    """The call format to parse: ``setting`` unless it is ``auto``, else the template's (module docstring)."""
    if setting != "auto":
        return setting
    if not template_supports_tools(template):
        return "hermes"  # what the system prompt asks for
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "json"


def _signature(schema: dict[str, Any]) -> str:
    fn = schema.get("function", schema)
    props = (fn.get("parameters") or {}).get("properties") or {}
    args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
    return f"{fn['name']}({args}): {fn.get('description', '').strip()}"


def _example(schema: dict[str, Any], fmt: str) -> str:
    fn = schema.get("function", schema)
    props = (fn.get("parameters") or {}).get("properties") or {}
    samples = {"integer": 1, "number": 1.5, "string": "text", "boolean": True, "array": [], "object": {}}
    args = ", ".join(f'"{k}": {json.dumps(samples.get(v.get("type"), 1))}' for k, v in props.items())
    return _EXAMPLE[fmt].format(name=fn["name"], args=args)


def tools_system_prompt(schemas: list[dict[str, Any]], style: str = "json", fmt: str = "hermes") -> str:
    """The text that describes ``schemas`` to a model whose template cannot (module docstring)."""
    if style == "json":
        if fmt != "hermes":  # the same listing, the instruction in the format asked for
            footer = ("</tools>\n\nFor each function call, return a json object with function name and "
                      f"arguments, like:\n{_example(schemas[0], fmt)}")
        else:
            footer = JSON_FOOTER
        return "\n".join([JSON_HEADER, *(json.dumps(s) for s in schemas), footer])
    if style == "list":
        lines = "\n".join(f"- {_signature(s)}" for s in schemas)
        return (f"You can call these tools:\n{lines}\nTo call one, write {_example(schemas[0], fmt)}. "
                "Its result comes back in the next message. When you know the answer, reply without a call.")
    raise ValueError(f"unknown tool prompt style {style!r}; known: json, list")


def with_tool_system_prompt(prompt: str | list[dict[str, Any]], schemas: list[dict[str, Any]],
                            style: str = "json", fmt: str = "hermes") -> list[dict[str, Any]]:
    """``prompt`` (text: one user message) as messages with the tools' description in the system
    message: appended to the conversation's own after a blank line, or as a new first message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    text = tools_system_prompt(schemas, style, fmt)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        return messages
    return [{"role": "system", "content": text}, *messages]
