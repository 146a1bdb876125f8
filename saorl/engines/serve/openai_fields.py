"""The fields of vLLM 0.32's OpenAI requests that saorl's engine cannot honour, and their neutral values.

vLLM accepts each of these (``vllm/entrypoints/openai/completion/protocol.py`` and
``chat_completion/protocol.py``). The local engine samples from temperature, top-k and top-p only
(:mod:`saorl.engines.sampling`, the one distribution the trainer scores with), so a request that
sets one of these fields to anything but its neutral value — the value under which vLLM samples
exactly as without the field — gets a 400 naming the field; at the neutral value it is accepted and
changes nothing. A client that sends vLLM's fields at their defaults (the ``openai`` client with
``extra_body``, a router that fills every field in) is served; one that relies on a penalty is told.

:data:`UNHONOURED` is the one table: field → (is the value neutral, the neutral value in words).
:class:`UnhonouredFields` declares them for pydantic; the chat-only ones are in
:class:`UnhonouredChatFields`. docs/engines.md lists the same table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
"""Every request schema's configuration: strict types, no unknown fields, finite numbers."""


def _zero_biases(bias: dict[str, float]) -> bool:
    return all(v == 0 for v in bias.values())


def _text_format(fmt: dict[str, Any]) -> bool:
    return fmt.get("type") == "text" and len(fmt) == 1


UNHONOURED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (lambda v: v == 0, "0"),
    "frequency_penalty": (lambda v: v == 0, "0"),
    "repetition_penalty": (lambda v: v == 1, "1"),
    "min_p": (lambda v: v == 0, "0"),
    "logit_bias": (_zero_biases, "{} (or every bias 0)"),
    "min_tokens": (lambda v: v == 0, "0"),
    "ignore_eos": (lambda v: v is False, "false"),
    "use_beam_search": (lambda v: v is False, "false"),
    "length_penalty": (lambda v: v == 1, "1 (it applies to beam search only)"),
    "bad_words": (lambda v: not v, "[]"),
    "allowed_token_ids": (lambda v: v is None, "null"),
    "prompt_logprobs": (lambda v: v is None, "null"),
    "logprob_token_ids": (lambda v: v is None, "null"),
    "truncate_prompt_tokens": (lambda v: v is None, "null"),
    "priority": (lambda v: v == 0, "0 (no priority scheduling)"),
    "spaces_between_special_tokens": (lambda v: v is True, "true"),
    "response_format": (_text_format, '{"type": "text"} or null'),
    "watermarking": (lambda v: not v, "false or null"),
    "echo": (lambda v: v is False, "false"),
    # chat only
    "tools": (lambda v: v is None, "null (no tool parser)"),
    "tool_choice": (lambda v: v in (None, "none"), '"none" or null'),
    "reasoning_effort": (lambda v: v is None, "null (no reasoning parser)"),
    "documents": (lambda v: v is None, "null"),
    "chat_template": (lambda v: v is None, "null: a request's own chat template is not trusted (vLLM "
                                           "refuses it too, without --trust-request-chat-template)"),
}
"""Field → (is this value neutral, the neutral value as the 400 states it)."""


class UnhonouredFields(BaseModel):
    """The fields of :data:`UNHONOURED` both routes take, typed as vLLM types them; None = unset."""
    model_config = STRICT

    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    logit_bias: Annotated[dict[TokenKey, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=1024)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    ignore_eos: bool = False
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(ge=-100.0, le=100.0)] = 1.0
    bad_words: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)] = Field(
        default_factory=list)
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=-1, le=20)] | None = None
    logprob_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, lt=2**63)] | None = None
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63)] = 0
    spaces_between_special_tokens: bool = True
    response_format: Annotated[dict[str, Any], Field(max_length=8)] | None = None
    watermarking: bool | None = None
    echo: bool = False

    def unhonoured(self) -> tuple[str, Any, str] | None:
        """The first field set to a value the engine cannot honour: ``(field, value, neutral)``."""
        for name in type(self).model_fields:
            if name in UNHONOURED:
                value = getattr(self, name)
                neutral, says = UNHONOURED[name]
                if value is not None and not neutral(value):
                    return name, value, says
        return None


class UnhonouredChatFields(BaseModel):
    """The chat-only fields of :data:`UNHONOURED`, and two that have no effect without tools or a
    reasoning parser (``parallel_tool_calls``, ``include_reasoning``: accepted, whatever their value)."""
    model_config = STRICT

    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    documents: Annotated[list[dict[str, str]], Field(max_length=64)] | None = None
    chat_template: Annotated[str, Field(max_length=65536)] | None = None
