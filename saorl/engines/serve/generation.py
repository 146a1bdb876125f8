"""One generation request's work, shared by the routes of ``saorl serve`` (:mod:`saorl.engines.serve.server`),
its streaming responses (:mod:`saorl.engines.serve.streaming`) and the emulated vLLM / SGLang routes
(:mod:`saorl.engines.serve.emulation`): the request body read as JSON, each prompt's token budget, every
choice of every prompt generated on the server's engine, and the engine's own validation turned into
a 400. Kept below those three modules, so none of them imports another to reach these.

The budget, as vLLM 0.32 sets it (``get_max_tokens`` in ``vllm/entrypoints/serve/utils/api_utils.py``):
a prompt longer than the context (``max_model_len``) is a 400 naming ``input_tokens``; the completion
gets ``min(max_tokens, max_model_len - prompt tokens)``, where an unset ``max_tokens`` is 16 for
completions and, for chat, the model's ``generation_config.json`` ``max_new_tokens`` or else all the
context leaves; a budget below 1 (a prompt that fills the context) is a 400 naming ``max_tokens``.
Greedy sampling (temperature 0) with ``n`` > 1 is a 400, as in vLLM: the choices would be copies.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from saorl.engines.base import GenerationResult, SamplingParams
from saorl.engines.serve import openai_api as oa

T = TypeVar("T")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


OFF_LOOP_BYTES = 64 * 2**10
"""Bodies (and texts) past this are parsed (tokenized) on a worker thread: work of more than a few
milliseconds never runs on the event loop, which keeps answering ``/health`` and the other requests."""
DISCONNECT_POLL_S = 0.1
"""How often a request being generated checks that its client is still there."""


class ClientGone(Exception):
    """The client closed the connection before its response was ready; its generation was cancelled."""

    def __init__(self, choices: int = 1) -> None:
        super().__init__(f"the client left; {choices} generation(s) cancelled")
        self.choices = choices
        """The generations cancelled with it (``/metrics`` counts each as finished by ``abort``)."""


async def unless_gone(request: Request, work: Awaitable[T], choices: int = 1) -> T:
    """``work``'s result; cancelled (and :class:`ClientGone` raised) as soon as the client has
    disconnected, checked every :data:`DISCONNECT_POLL_S`: an abandoned request stops costing the
    engine within a fraction of a second, streamed or not. ``choices``: the generations ``work``
    runs."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone(choices)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its engine requests are cancelled


async def off_loop(size: int, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)``: on a worker thread when ``size`` (bytes or characters) is past
    :data:`OFF_LOOP_BYTES`, else here (a thread costs more than a small call)."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args, **kw)
    return fn(*args, **kw)


async def json_response(payload: Any, size: int) -> Response:
    """``payload`` as FastAPI would send it (byte for byte), encoded on a worker thread when ``size``
    (about its bytes) is large: a million token ids take seconds to encode."""
    if size <= OFF_LOOP_BYTES:
        return JSONResponse(jsonable_encoder(payload))
    body = await asyncio.to_thread(lambda: render_json(payload).encode())
    return Response(body, media_type="application/json")


_SLICE = 4096


def render_json(value: Any) -> str:
    """``json.dumps`` as :class:`JSONResponse` renders FastAPI's encoding of ``value``, but a long
    list a slice at a time: one ``json.dumps`` of a million items holds the GIL for a fifth of a
    second, stalling the event loop however it is threaded; slices of 4096 let it in between. (No
    ``jsonable_encoder`` pass first: on a million items it is seconds of Python contending for the GIL.)"""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_dumps(str(k))}:{render_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > _SLICE:
        return "[" + ",".join(_dumps(value[i:i + _SLICE])[1:-1] for i in range(0, len(value), _SLICE)) + "]"
    return _dumps(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"),
                      default=jsonable_encoder)  # (what is not plain JSON, as FastAPI converts it)


def too_long(state, n_tokens: int, which: str = "the prompt") -> None:
    """The 400 of a prompt longer than the served context (``max_model_len``)."""
    limit = state.served.max_model_len
    if limit is not None and n_tokens > limit:
        raise oa.BadRequest(f"input_tokens: {which} has {n_tokens} tokens, more than the model's context of "
                            f"{limit} tokens (--max-model-len)", "input_tokens")


def encode_texts(state, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Each text's token ids, each checked against the context as soon as it is tokenized (a batch
    of long prompts is refused at the first, not after all); run it with :func:`off_loop`."""
    out = []
    for i, text in enumerate(texts):
        ids = list(state.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        too_long(state, len(ids), f"prompt {i}" if len(texts) > 1 else "the prompt")
        out.append(ids)
    return out


async def read_json(request: Request) -> Any:
    """The body as JSON (nested at most ``max_json_depth`` deep: the server's middleware saw to it);
    400 for what is not JSON, or a string no tokenizer or path can take (a lone UTF-16 surrogate:
    JSON lets ``"\\ud800"`` through, UTF-8 does not). A large body is parsed off the event loop."""
    raw = await request.body()
    return await off_loop(len(raw), _parse, raw)


def _parse(raw: bytes) -> Any:
    try:  # a ValueError: malformed, not UTF-8, or a number past Python's 4300 digits
        body = json.loads(raw or b"null")
        if _SURROGATE.search(raw):
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise oa.BadRequest("body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff not in a "
                            "pair), which is not text") from None
    except ValueError as e:
        raise oa.BadRequest(f"body is not valid JSON: {e}") from None
    return body


def engine_bad_request(e: ValueError) -> oa.BadRequest:
    """The engine's own validation (token ids out of range, prompt too long) as a 400."""
    msg = str(e)
    first = msg.split(" ", 1)[0].rstrip(":")
    param = first if first in ("prompt", "stop", "stop_token_ids", "seed", "max_tokens") else None
    return oa.BadRequest(msg, param)


def budgets(state, req: oa._Request, prompts: list[list[int]]) -> list[int]:
    """Each prompt's ``max_tokens`` (module docstring); 400s for a prompt the context cannot take."""
    served = state.served
    limit = served.max_model_len
    if isinstance(req, oa.ChatRequest):
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        asked = asked if asked is not None else served.defaults.get("max_tokens")
    else:
        asked = req.max_tokens if req.max_tokens is not None else 16
    out = []
    for p in prompts:
        too_long(state, len(p))
        left = None if limit is None else limit - len(p)
        n = min(x for x in (asked, left) if x is not None) if (asked, left) != (None, None) else 16
        if n < 1:
            raise oa.BadRequest(f"max_tokens: the prompt's {len(p)} tokens fill the model's context of "
                                f"{limit} tokens, which leaves none to generate (max_tokens would be 0)",
                                "max_tokens")
        out.append(n)
    return out


def sampling_for(state, req: oa._Request, max_tokens: int, top: int, seed: int | None) -> SamplingParams:
    sp = req.sampling(max_tokens, top, seed, state.served.defaults, state.served.extra_eos)
    if sp.temperature == 0 and req.n > 1:
        raise oa.BadRequest(f"n: greedy sampling (temperature 0) gives {req.n} copies of one choice; "
                            "send n: 1 or a temperature above 0", "n")
    return sp


Work = list[tuple[list[int], SamplingParams]]


def plan(state, req: oa._Request, prompts: list[list[int]], top: int) -> Work:
    """Every choice of every prompt with its sampling, in order ``[p0c0, p0c1, ..., p1c0, ...]``;
    the 400s of the module docstring before anything is generated (or a stream started)."""
    out = []
    for prompt, budget in zip(prompts, budgets(state, req, prompts)):
        out += [(prompt, sampling_for(state, req, budget, top, seed)) for seed in req.seeds()]
    return out


async def generate_all(state, work: Work,
                       on_token: Callable[[int], Any] | None = None) -> list[GenerationResult]:
    """The choices of ``work`` (:func:`plan`), on ``state``'s engine (a
    :class:`~saorl.engines.serve.server.ServerState`: ``engine``, ``streams``, ``running``)."""
    calls = []
    for prompt, sp in work:
        kw = {"on_token": on_token(len(calls))} if on_token is not None and state.streams else {}
        calls.append(state.engine.agenerate(prompt, sp, **kw))
    state.running += len(calls)
    try:
        return list(await asyncio.gather(*calls))
    except ValueError as e:
        raise engine_bad_request(e) from None
    finally:
        state.running -= len(calls)
