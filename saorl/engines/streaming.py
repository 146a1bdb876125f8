"""Server-sent events for ``stream: true`` completions and chat completions.

One event per sampled token and choice, as the engine samples it (the engine's ``on_token`` hook),
then one closing event per choice with its ``finish_reason``, an optional usage event
(``stream_options.include_usage``) and ``data: [DONE]``. Text deltas never contain an incomplete
UTF-8 character or text that may turn out to start a stop string (held back until it is clear);
the closing event carries whatever text is left, cut before the stop string. Token ids and
log-probs are sent as sampled. An engine without the hook streams each choice in one piece when
it finishes. An engine failure mid-stream ends it with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from saorl.engines import openai_api as oa
from saorl.engines.base import EngineError, GenerationResult
from saorl.engines.generation import generate_all


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Choice:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.alts: list = []
        self.sent_chars = 0
        self.sent_tokens = 0

    def partial(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.logprobs, "abort", self.versions, None, {},
                                self.alts if self.alts else None)


def _delta(state, req, chat: bool, i: int, c: _Choice, text: str, res: GenerationResult,
           finish: str | None, stop: Any) -> dict:
    start = c.sent_tokens
    new_ids = res.token_ids[start:]
    if chat:
        lp = oa.chat_logprobs(state.tokenizer, res, False, start) if req.logprobs and new_ids else None
        delta = {"content": text}
        if not c.sent_tokens and not c.sent_chars:
            delta["role"] = "assistant"
        out = dict(index=i, delta=delta, logprobs=lp, finish_reason=finish)
    else:
        as_ids = bool(req.return_tokens_as_token_ids)
        lp = (oa.completion_logprobs(state.tokenizer, res, as_ids, start)
              if req.logprobs is not None and new_ids else None)
        out = dict(index=i, text=text, logprobs=lp, finish_reason=finish)
    out["stop_reason"] = stop
    if req.return_token_ids or state.emulate is None:
        out["token_ids"] = new_ids
    if state.emulate is None:
        out["versions"] = res.versions[start:]
    c.sent_tokens = len(res.token_ids)
    c.sent_chars += len(text)
    return out


async def stream_events(state, req, prompts: list[list[int]], top: int, chat: bool) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    n = len(prompts) * req.n
    choices = [_Choice() for _ in range(n)]
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    kind = "chat.completion.chunk" if chat else "text_completion"
    rid, model = oa.new_id("chatcmpl" if chat else "cmpl"), req.model or state.model_name

    def hook(i: int):
        return lambda t, lp, v, alts: loop.call_soon_threadsafe(queue.put_nowait, ("tok", i, t, lp, v, alts))

    async def run() -> None:
        try:
            queue.put_nowait(("done", await generate_all(state, prompts, req, top, hook)))
        except Exception as e:  # reported in the stream: the status line is already sent
            queue.put_nowait(("error", e))

    task = asyncio.create_task(run())
    try:
        while True:
            item = await queue.get()
            if item[0] == "tok":
                _, i, t, lp, v, alts = item
                c = choices[i]
                c.tokens.append(t)
                c.logprobs.append(lp)
                c.versions.append(v)
                if alts is not None:
                    c.alts.append(alts)
                text = oa.streamable_text(state.tokenizer, c.tokens, stops) if state.tokenizer else ""
                choice = _delta(state, req, chat, i, c, text[c.sent_chars:], c.partial(), None, None)
                yield _sse(oa.envelope(kind, rid, model, [choice]))
            elif item[0] == "done":
                results = item[1]
                for i, (c, res) in enumerate(zip(choices, results)):
                    final = oa.response_text(state.tokenizer, res, req.include_stop_str_in_output)
                    choice = _delta(state, req, chat, i, c, final[c.sent_chars:], res, res.finish_reason,
                                    res.stop_reason)
                    yield _sse(oa.envelope(kind, rid, model, [choice]))
                if req.stream_options and req.stream_options.get("include_usage"):
                    plens = [len(p) for p in prompts for _ in range(req.n)]
                    yield _sse(oa.envelope(kind, rid, model, [], oa.usage(plens, results)))
                break
            else:
                e = item[1]
                code = 400 if isinstance(e, oa.BadRequest) else 503
                kind_ = "invalid_request_error" if code == 400 else "engine_error"
                if not isinstance(e, (oa.BadRequest, EngineError)):
                    kind_ = "internal_error"
                yield _sse({"error": {"message": str(e), "type": kind_, "code": code}})
                break
        yield "data: [DONE]\n\n"
    finally:
        task.cancel()
