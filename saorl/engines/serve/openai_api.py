"""The OpenAI-compatible request schemas of ``saorl serve`` (the responses:
:mod:`saorl.engines.serve.openai_out`).

Requests are validated field by field (pydantic, strict types, no extra fields, finite numbers
only): a malformed request gets HTTP 400 whose ``error.param`` and message name the field, never a
silent default. ``1e400`` (which JSON parsers read as infinity), ``NaN``, a string where a number
belongs, a number where a list of strings belongs — each is a 400. A field vLLM 0.32 does not know
either is a 400 ("unsupported field"; vLLM ignores it), so a misspelt field is never silently
dropped.

``POST /v1/completions`` (vLLM's ``CompletionRequest`` names): ``prompt`` (token ids, a list of
token-id lists, a string or a list of strings; strings need the server's tokenizer), ``max_tokens``
(16; at most what the context leaves), ``temperature``, ``top_p``, ``top_k`` (-1 or 0 = off; unset:
the model's ``generation_config.json`` default, else 1 / 1 / off), ``n``, ``stream`` (SSE),
``stream_options`` (``include_usage``, ``continuous_usage_stats``), ``logprobs`` (k: the sampled
token's log-prob plus the k most likely alternatives per token), ``stop``, ``stop_token_ids``,
``seed``, ``return_token_ids``, ``return_tokens_as_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``add_special_tokens``, ``request_id`` (the response's id is
``cmpl-<request_id>``), ``cache_salt`` (accepted: the local engine keeps no prefix cache across
requests), ``model``, ``user``; the fields of :mod:`saorl.engines.serve.openai_fields` at their neutral
values; saorl's extension ``return_routed_experts`` (non-streaming, on a server started with
``--enable-return-routed-experts``): each choice's ``routed_experts``, the MoE routes of every
position fed (:mod:`saorl.engines.clients.routes`).

``POST /v1/chat/completions``: ``messages`` (content a string or a list of text parts) go through
the tokenizer's chat template (:mod:`saorl.engines.serve.chat_prompt`) with ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``; ``max_completion_tokens`` / ``max_tokens``
(unset: the model's ``generation_config.json`` ``max_new_tokens``, else what the context leaves),
``logprobs: true`` with ``top_logprobs: k``; the other sampling fields as above.

``POST /tokenize`` (``prompt`` or ``messages``) and ``POST /detokenize`` (``tokens``): vLLM's
tokenizer routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from saorl.engines.base import SamplingParams
from saorl.engines.serve.openai_fields import STRICT, UnhonouredChatFields, UnhonouredFields

TokenId = Annotated[int, Field(strict=True, ge=0)]
StopStr = Annotated[str, Field(min_length=1, max_length=256)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; ``param`` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(LookupError):
    """A request naming a model the server does not serve: HTTP 404 with ``param: "model"``."""


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Request(UnhonouredFields):
    model_config = STRICT

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    seed: Seed | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, max_tokens: int, top_logprobs: int, seed: int | None, defaults: dict[str, Any],
                 extra_stop_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The engine's parameters: each unset field from ``defaults`` (the model's
        ``generation_config.json``, :class:`~saorl.engines.serve.served.ServedModel`), else neutral."""
        def pick(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, neutral)

        stop_ids = tuple(dict.fromkeys([*(self.stop_token_ids or ()), *extra_stop_ids]))
        return SamplingParams(temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                              top_k=max(pick("top_k", 0), 0), max_new_tokens=max_tokens, stop=self.stops(),
                              stop_token_ids=stop_ids, seed=seed, top_logprobs=top_logprobs)

    def seeds(self) -> list[int | None]:
        """One seed per choice: ``seed + i`` (distinct samples, reproducible), or all None."""
        return [None if self.seed is None else (self.seed + i) % 2**63 for i in range(self.n)]


class CompletionRequest(_Request):
    prompt: (Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Annotated[
        list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
             | Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=64)])
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_special_tokens: bool = True
    suffix: None = None
    return_routed_experts: bool = False
    """saorl's extension: each choice carries ``routed_experts`` (see :mod:`saorl.engines.clients.routes`)."""


class TextPart(BaseModel):
    """A content part of a chat message; only ``{"type": "text", "text": ...}`` can be served (a
    part of another type is a 400 naming it: the models are text only)."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: Annotated[str, Field(max_length=64)]
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], Field(max_length=256)] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatFields(BaseModel):
    """What a chat request (and a chat ``/tokenize``) says of its prompt."""
    model_config = STRICT
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = None


class ChatRequest(_Request, ChatFields, UnhonouredChatFields):
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


class TokenizeCompletion(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(ChatFields):
    model_config = STRICT
    model: str | None = None
    return_token_strs: bool | None = False


class Detokenize(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**63)]], Field(max_length=1_000_000)]


class WeightUpdate(BaseModel):
    """``POST /update_weights``, saorl's own route: load the weights file or directory ``path`` (under
    the server's ``--weights-dir``) as ``version``."""
    model_config = STRICT
    path: str
    version: Annotated[int, Field(ge=0, lt=2**63)]


def request_body(model: type[BaseModel] | tuple[type[BaseModel], ...]) -> dict:
    """The OpenAPI ``requestBody`` of a route that reads ``model`` (or one of several) itself
    (FastAPI's ``openapi_extra``), self-contained: pydantic's ``$defs`` inlined, as they would point
    nowhere in the document."""
    models = model if isinstance(model, tuple) else (model,)
    schemas = [m.model_json_schema() for m in models]
    defs = {k: v for s in schemas for k, v in s.pop("$defs", {}).items()}

    def inline(x: Any) -> Any:
        if isinstance(x, dict):
            return inline(defs[x["$ref"].rsplit("/", 1)[1]]) if "$ref" in x else {
                k: inline(v) for k, v in x.items()}
        return [inline(v) for v in x] if isinstance(x, list) else x

    schema = inline(schemas[0]) if len(schemas) == 1 else {"anyOf": [inline(s) for s in schemas]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` validated as ``model``, or :class:`BadRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        out = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        detail = "unsupported field" if err["type"] == "extra_forbidden" else err["msg"]
        if not err["loc"] and ": " in err["msg"]:  # a model validator's "<field>: <why>"
            field, detail = err["msg"].removeprefix("Value error, ").split(": ", 1)
            raise BadRequest(f"{field}: {detail}", field) from None
        value = err.get("input")
        shown = repr(value)[:80] if not isinstance(value, dict) else "an object"
        raise BadRequest(f"{field}: {detail} (got {shown})", field) from None
    return out


def refuse_unhonoured(req: UnhonouredFields) -> None:
    """:class:`BadRequest` naming the first field set to a value the engine cannot honour
    (:mod:`saorl.engines.serve.openai_fields`); checked after the model name, as vLLM would answer
    404 first."""
    bad = req.unhonoured()
    if bad is not None:
        name, value, neutral = bad
        raise BadRequest(f"{name}: saorl serve's engine samples with temperature, top-k and top-p only and "
                         f"cannot apply {name}={str(value)[:80]}; leave it out or send {neutral}", name)
