"""An agent's messages and ``tools`` as prompt ids, and the model's tool calls read out of its reply.

Messages come as the OpenAI API sends them: a content may be a list of text parts (joined with
``"\\n"``, as vLLM does), an assistant message may carry ``tool_calls`` whose ``arguments`` are a JSON
string (read into the object chat templates take). Then the run's chat template renders them
(:meth:`~saorl.models.codec.RunTokenizer.prompt_ids`):

- a template that takes ``tools`` (it reads the variable: Qwen2.5/3, Llama 3.1, Hermes) gets them,
  and renders the earlier calls itself;
- a template that does not (SmolLM2's, ChatML without tools) gets them as a block at the end of the
  system message (one is added first when there is none), as ``env.tools`` describes them
  (:func:`saorl.envs.tool_prompt.with_tool_system_prompt`, its ``json`` style: the schemas as JSON
  lines inside ``<tools></tools>`` and the instruction to answer a call in the ``tool_format``, by
  default ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). An assistant message with
  ``tool_calls`` is then rendered as the text the model wrote, when it is a reply this episode gave
  (so the conversation joins token-exactly, :mod:`saorl.agent.openai_record`), else as its content
  followed by one ``<tool_call>`` block per call.

The reply's calls are read with :func:`saorl.envs.tool_calls.parse_tool_calls` in the env's
``tool_format`` (``hermes`` by default): the reply's ``content`` is the text outside the calls (None
when there is none), its ``tool_calls`` the calls with their arguments as JSON strings. A malformed
call stays in the content as text, as a server without a parser would return it.
"""

from __future__ import annotations

import json
from typing import Any

from saorl.envs.tool_calls import TOOL_CALL_FORMATS, parse_tool_calls
from saorl.envs.tool_prompt import template_supports_tools, with_tool_system_prompt
from saorl.models.codec import RunTokenizer


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text") or "" for part in content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
    return value


def _native_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}}


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


class ToolRendering:
    """One episode's rendering of messages and tools, and its reading of tool calls (module docstring)."""

    def __init__(self, codec: RunTokenizer, fmt: str) -> None:
        if fmt not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_format must be one of {list(TOOL_CALL_FORMATS)}, got {fmt!r}")
        self.codec, self.fmt = codec, fmt
        template = getattr(codec.hf, "chat_template", None)
        self.native = isinstance(template, str) and template_supports_tools(template)
        self.written: dict[tuple[str, ...], str] = {}
        """The text the model wrote for each reply with calls, by its calls' ids."""

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        msgs = [self._message(m, tools) for m in messages]
        if tools and not self.native:  # described in the system message, as env.tools does (json style)
            msgs = with_tool_system_prompt(msgs, tools, "json", self.fmt)
            tools = None
        return self.codec.prompt_ids(msgs, tools or None)

    def _message(self, m: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        out = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id")}
        out["content"] = _text(m.get("content"))
        calls = m.get("tool_calls")
        if not calls:
            return out
        if self.native and tools:
            out["tool_calls"] = [_native_call(c) for c in calls]
            return out
        written = self.written.get(tuple(str(c.get("id")) for c in calls))
        if written is not None:
            out["content"] = written
        else:
            out["content"] = "\n".join([t for t in (out["content"],) if t] + [_call_text(c) for c in calls])
        return out

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply's ``content`` and ``tool_calls`` (OpenAI's form) read out of ``text``."""
        turn = parse_tool_calls(text, self.fmt)
        if not turn.calls:
            return text, []
        calls = [{"id": f"call_{len(self.written)}_{i}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                 for i, c in enumerate(turn.calls)]
        self.written[tuple(c["id"] for c in calls)] = text
        content = turn.content if not turn.errors else text
        return content or None, calls
