"""Native tool calls in an episode: the agent loop's side of ``env.tools``.

For an env that has tools (``env.toolbox``, given by the run's env factory:
:mod:`saorl.envs.toolbox`), one :class:`ToolTurns` per episode does what TRL's
``GRPOTrainer(tools=[...])`` does between the model's turns::

    prompt: the tools' schemas through the chat template (tools=...) if it reads them,
            else in the system message (saorl.envs.tool_prompt)
    each turn, the model's reply is parsed in its family's call format (saorl.envs.tool_calls):
        calls (or malformed calls) and turns left -> each call checked against its schema and run
            (under env.call_timeout_s); every result, or the error text, is a `tool` message
            (one per call) that the loop adds through the template; env.step is not called
        no call, or the last turn (max_turns)     -> env.note_completion(messages); env.step(reply)

So the episode ends when the model answers without a call (the env scores that answer) or at
``max_turns`` (``env.tool_max_turns``), whose reply the env scores as it is, calls and all, as
TRL scores a completion cut at its tool-calling limit. What the env's ``step`` receives besides
the reply: the whole completion as chat messages (:meth:`Env.note_completion`), TRL's form — each
calling turn as ``{"role": "assistant", "content": text outside the calls, "tool_calls": [...]}``,
each result as ``{"role": "tool", "name": ..., "content": ...}``, the final reply as
``{"role": "assistant", "content": reply}``; ``prompt_reward`` hands these to the reward
functions as the completion, as TRL does.

Errors never end the episode: a malformed call (bad JSON, no name, arguments not an object), an
unknown function, arguments that do not fit the schema (:func:`~saorl.envs.tool_calls.argument_errors`)
or cannot be bound, a tool that raises or runs past the deadline are each one ``tool`` message
starting ``error:`` that the model reads. The final step's ``info["metrics"]`` gets ``tool_calls``
and ``tool_errors``, the episode's counts, logged per trainer step as ``env/tool_calls`` and
``env/tool_errors`` (batch means). A turn runs at most ``env.tool_max_calls`` calls, so that one
reply costs at most that many deadlines, and none after a call that ran past its deadline: the
calls not run are each answered ``error: not run (...)``, and counted as errors too.

Tokens: the loop appends each tool message as observation ids (``action_mask`` 0) after the
model's sampled ids, never re-tokenizing them (:mod:`saorl.models.chat_turns`), so the trainer
scores exactly what the engine sampled and skip-observation GAE jumps the tool results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from saorl.envs.base import Env, Prompt
from saorl.envs.tool_calls import argument_errors, function_schema, parse_tool_calls, tool_stop_strings
from saorl.envs.tool_prompt import (
    call_format,
    template_supports_tools,
    tools_system_prompt,
    with_tool_system_prompt,
)
from saorl.envs.toolbox import Tools
from saorl.models.codec import RunTokenizer

__all__ = ["ToolTurns", "tool_schemas", "with_tools"]


@functools.lru_cache(maxsize=256)
def _schema(fn: Callable[..., Any]) -> dict[str, Any]:
    return function_schema(fn)


def tool_schemas(functions: Mapping[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """The schema of each tool, in order (:func:`~saorl.envs.tool_calls.function_schema`, cached);
    :class:`~saorl.envs.tool_calls.ToolSchemaError` for one that cannot be a tool."""
    return [_schema(fn) for fn in functions.values()]


class ToolTurns:
    """One episode's tool calls (module docstring)."""

    def __init__(self, tools: Tools, codec: RunTokenizer, max_turns: int) -> None:
        opts = tools.options
        self.tools, self.max_turns, self.style = tools, max_turns, opts.prompt
        self.schemas = tool_schemas(tools.functions)
        self.by_name = {s["function"]["name"]: s for s in self.schemas}
        template = codec.hf.chat_template if codec.applies_chat_template else None
        self.native = template_supports_tools(template)
        """Whether the schemas go through the chat template (else saorl writes them)."""
        self.format = call_format(template, opts.format)
        self.stop_strings = tool_stop_strings(self.format) if opts.stop else ()
        self.templated = codec.applies_chat_template
        self.completion: list[dict[str, Any]] = []
        """The completion so far as chat messages (module docstring)."""
        self.max_calls = opts.max_calls
        self.calls = self.errors = self.turns = 0

    def codec(self, codec: RunTokenizer) -> RunTokenizer:
        """``codec``, rendering every conversation with ``tools=`` when the template reads them."""
        if not self.native:
            return codec
        kwargs = {**codec.spec.chat_template_kwargs, "tools": self.schemas}
        return RunTokenizer(codec.hf, replace(codec.spec, chat_template_kwargs=kwargs))

    def prompt(self, prompt: Prompt) -> Prompt:
        """The prompt with the tools' description where the template does not write it."""
        if self.native:
            return prompt
        if not self.templated and isinstance(prompt, str):  # no template at all: text before the prompt
            return f"{tools_system_prompt(self.schemas, self.style, self.format)}\n\n{prompt}"
        return with_tool_system_prompt(prompt, self.schemas, self.style, self.format)

    def run(self, action: str) -> list[str] | None:
        """The results of the calls in ``action`` (one text per tool message), or None when the
        reply goes to ``env.step``: it calls no tool, or it is the last turn."""
        self.turns += 1
        parsed = parse_tool_calls(action, self.format)
        if (not parsed.calls and not parsed.errors) or self.turns >= self.max_turns:
            self.completion.append({"role": "assistant", "content": action})
            return None
        self.completion.append({"role": "assistant", "content": parsed.content,
                                "tool_calls": [c.message_call() for c in parsed.calls]})
        results: list[tuple[str, str, bool]] = []  # (tool name, text, is an error)
        timed_out = False
        for k, call in enumerate(parsed.calls):
            schema = self.by_name.get(call.name)
            if k >= self.max_calls:
                results.append((call.name, f"error: not run (a turn runs at most {self.max_calls} tool "
                                           "calls; make the others in a later turn)", True))
            elif timed_out:
                results.append((call.name, "error: not run (an earlier call of this turn ran past its "
                                           "deadline)", True))
            elif schema is None:
                results.append((call.name, f"error: unknown tool {call.name!r}; the tools are: "
                                           f"{', '.join(self.by_name)}", True))
            elif bad := argument_errors(schema, call.arguments):
                results.append((call.name, f"error: bad arguments for {call.name}: {'; '.join(bad)}", True))
            else:
                result = self.tools.call(call.name, call.arguments)
                timed_out = result.timed_out
                results.append((call.name, result.text, result.error))
        results += [("", f"error: malformed tool call: {e}", True) for e in parsed.errors]
        self.calls += len(results)
        self.errors += sum(error for _, _, error in results)
        self.completion += [{"role": "tool", "name": name, "content": text} if name else
                            {"role": "tool", "content": text} for name, text, _ in results]
        return [text for _, text, _ in results]

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "tool_errors": float(self.errors)}


def with_tools(env: Env, codec: RunTokenizer, prompt: Prompt) -> tuple[RunTokenizer, Prompt]:
    """The tokenizer and prompt an episode of ``env`` renders (the tools' schemas in it, when
    ``env`` has tools), for counting a prompt's tokens as the agent loop will."""
    if env.toolbox is None:
        return codec, prompt
    turns = ToolTurns(env.toolbox, codec, 1)
    return turns.codec(codec), turns.prompt(prompt)
