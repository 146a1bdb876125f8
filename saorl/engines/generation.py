"""One generation request's work, shared by the routes of ``saorl serve`` (:mod:`saorl.engines.server`),
its streaming responses (:mod:`saorl.engines.streaming`) and the emulated vLLM / SGLang routes
(:mod:`saorl.engines.emulation`): the request body read as JSON, every choice of every prompt
generated on the server's engine, and the engine's own validation turned into a 400. Kept below
those three modules, so none of them imports another to reach these.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request

from saorl.engines import openai_api as oa
from saorl.engines.base import GenerationResult

_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(request: Request) -> Any:
    """The body as JSON (nested at most ``max_json_depth`` deep: the server's middleware saw to it);
    400 for what is not JSON, or a string no tokenizer or path can take (a lone UTF-16 surrogate:
    JSON lets ``"\\ud800"`` through, UTF-8 does not)."""
    raw = await request.body()
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


async def generate_all(state, prompts: list[list[int]], req: oa._Request, top: int,
                       on_token: Callable[[int], Any] | None = None) -> list[GenerationResult]:
    """Every choice of every prompt, in order ``[p0c0, p0c1, ..., p1c0, ...]``, on ``state``'s
    engine (a :class:`~saorl.engines.server.ServerState`: ``engine``, ``streams``, ``running``)."""
    calls = []
    for prompt in prompts:
        for seed in req.seeds():
            sp = req.sampling(max_tokens(req), top, seed)
            kw = {"on_token": on_token(len(calls))} if on_token is not None and state.streams else {}
            calls.append(state.engine.agenerate(prompt, sp, **kw))
    state.running += len(calls)
    try:
        return list(await asyncio.gather(*calls))
    except ValueError as e:
        raise engine_bad_request(e) from None
    finally:
        state.running -= len(calls)


def max_tokens(req: oa._Request) -> int:
    if isinstance(req, oa.ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens if req.max_tokens is not None else 16
