"""The OpenAI-compatible request schemas and responses of ``saorl serve``.

Requests are validated field by field (pydantic, strict types, no extra fields, finite numbers
only): a malformed request gets HTTP 400 whose ``error.param`` and message name the field, never a
silent default. ``1e400`` (which JSON parsers read as infinity), ``NaN``, a string where a number
belongs, a number where a list of strings belongs — each is a 400.

``POST /v1/completions`` (vLLM's ``CompletionRequest`` names): ``prompt`` (token ids, a list of
token-id lists, a string or a list of strings; strings need the server's tokenizer), ``max_tokens``
(16), ``temperature`` (1), ``top_p``, ``top_k`` (-1 or 0 = off), ``n``, ``stream`` (SSE),
``stream_options.include_usage``, ``logprobs`` (k: the sampled token's log-prob plus the k most
likely alternatives per token), ``stop``, ``stop_token_ids``, ``seed``, ``return_token_ids``,
``return_tokens_as_token_ids``, ``include_stop_str_in_output``, ``cache_salt`` (accepted: the local
engine has no prefix cache), ``model``, ``user``; saorl's extension ``return_routed_experts``
(non-streaming, on a server started with ``--enable-return-routed-experts``): each choice's
``routed_experts``, the MoE routes of every position fed (:mod:`saorl.engines.routes`).

``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template (a server
without one refuses chat with a 400 saying so); ``max_tokens`` / ``max_completion_tokens``,
``logprobs: true`` with ``top_logprobs: k``; the other sampling fields as above.

Stop strings. The engine keeps every sampled token (``token_ids`` and the log-probs report exactly
what was sampled, the last token may run past the stop string); the returned *text* ends before
the stop string, as OpenAI and vLLM do (``include_stop_str_in_output: true`` keeps it). A stream
holds back text that could still turn out to be the start of a stop string.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from saorl.engines.base import GenerationResult, SamplingParams

Int = Annotated[int, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
StopStr = Annotated[str, Field(min_length=1, max_length=256)]


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; ``param`` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] = -1
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stream: bool = False
    stream_options: dict[Literal["include_usage"], bool] | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    return_token_ids: bool | None = None
    include_stop_str_in_output: bool = False
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    user: str | None = None

    def sampling(self, max_tokens: int, top_logprobs: int, seed: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_new_tokens=max_tokens, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), seed=seed,
                              top_logprobs=top_logprobs)

    def seeds(self) -> list[int | None]:
        """One seed per choice: ``seed + i`` (distinct samples, reproducible), or all None."""
        return [None if self.seed is None else (self.seed + i) % 2**63 for i in range(self.n)]


class CompletionRequest(_Request):
    prompt: (Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Annotated[
        list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
             | Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=64)])
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    return_tokens_as_token_ids: bool | None = None
    suffix: None = None
    return_routed_experts: bool = False
    """saorl's extension: each choice carries ``routed_experts`` (see :mod:`saorl.engines.routes`)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class WeightUpdate(BaseModel):
    """``POST /update_weights``, saorl's own route: load the weights file or directory ``path`` (under
    the server's ``--weights-dir``) as ``version``."""
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str
    version: Annotated[int, Field(ge=0, lt=2**63)]


def request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI ``requestBody`` of a route that reads ``model`` itself (FastAPI's ``openapi_extra``),
    self-contained: pydantic's ``$defs`` inlined, as they would point nowhere in the document."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(x: Any) -> Any:
        if isinstance(x, dict):
            return inline(defs[x["$ref"].rsplit("/", 1)[1]]) if "$ref" in x else {
                k: inline(v) for k, v in x.items()}
        return [inline(v) for v in x] if isinstance(x, list) else x

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` validated as ``model``, or :class:`BadRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        detail = "unsupported field" if err["type"] == "extra_forbidden" else err["msg"]
        value = err.get("input")
        shown = repr(value)[:80] if not isinstance(value, dict) else "an object"
        raise BadRequest(f"{field}: {detail} (got {shown})", field) from None


# ------------------------------------------------------------------------------------- text
def response_text(tokenizer, res: GenerationResult, include_stop: bool) -> str:
    """The completion's text: decoded without special tokens, ending before the stop string
    that finished it (or right after it with ``include_stop``)."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
    if res.finish_reason == "stop" and isinstance(res.stop_reason, str):
        at = text.find(res.stop_reason)
        if at >= 0:
            text = text[: at + (len(res.stop_reason) if include_stop else 0)]
    return text


def streamable_text(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> str:
    """The part of the decoded ``tokens`` that can be sent before the request ends: without a
    trailing incomplete UTF-8 character, and holding back what could be a stop string's start."""
    text = tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[: min(hits)]
    hold = max((len(s) - 1 for s in stops), default=0)
    return text[: len(text) - hold] if hold else text


def token_str(tokenizer, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids or tokenizer is None else tokenizer.decode([token])


# ------------------------------------------------------------------------------------- logprobs
def completion_logprobs(tokenizer, res: GenerationResult, as_ids: bool, start: int = 0) -> dict:
    """OpenAI completions ``logprobs`` for ``res``'s tokens from ``start`` on."""
    ids = res.token_ids[start:]
    tokens = [token_str(tokenizer, t, as_ids) for t in ids]
    top = None
    if res.top_logprobs is not None:
        top = [{token_str(tokenizer, a, as_ids): lp for a, lp in alts} for alts in res.top_logprobs[start:]]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return dict(tokens=tokens, token_logprobs=res.logprobs[start:], top_logprobs=top, text_offset=offsets)


def chat_logprobs(tokenizer, res: GenerationResult, as_ids: bool, start: int = 0) -> dict:
    """OpenAI chat ``logprobs.content`` for ``res``'s tokens from ``start`` on."""
    def entry(t: int, lp: float) -> dict:
        s = token_str(tokenizer, t, as_ids)
        return dict(token=s, logprob=lp, bytes=list(s.encode()))

    content = []
    for i in range(start, len(res.token_ids)):
        e = entry(res.token_ids[i], res.logprobs[i])
        alts = res.top_logprobs[i] if res.top_logprobs is not None else []
        e["top_logprobs"] = [entry(a, lp) for a, lp in alts]
        content.append(e)
    return dict(content=content)


# ------------------------------------------------------------------------------------- envelopes
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(kind: str, rid: str, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    out = dict(id=rid, object=kind, created=int(time.time()), model=model, choices=choices)
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_lens: list[int], results: list[GenerationResult]) -> dict:
    p, c = sum(prompt_lens), sum(len(r.token_ids) for r in results)
    return dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
