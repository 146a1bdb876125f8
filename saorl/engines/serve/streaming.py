"""Server-sent events for ``stream: true`` completions and chat completions, event for event as
vLLM 0.32 sends them.

A chat stream opens with one event per choice carrying ``delta: {"role", "content": ""}`` (and the
response's ``prompt_token_ids``, ``prompt_text``). Then one event per sampled token and choice,
in the order the engine samples them (its ``on_token`` hook); the last token's event carries the
choice's ``finish_reason`` and ``stop_reason`` (so a choice of k tokens is k events, as in vLLM: each
token event is held back until the next token, or the end, says whether it is the last), and, when
no usage event follows, the ``system_fingerprint``. With ``stream_options.include_usage`` a last
event with ``choices: []`` and the usage (prompts counted once); ``continuous_usage_stats`` adds
each choice's running usage to every event. Then ``data: [DONE]``.

Completions events carry ``text``, ``logprobs``, ``finish_reason``, ``stop_reason`` (null until the
end), ``prompt_token_ids`` (the first event of each choice, with ``return_token_ids``) and
``token_ids`` (the event's tokens, with ``return_token_ids``); chat events ``delta.content``,
``logprobs``, ``finish_reason``, ``token_ids`` and, at the end, ``stop_reason``. Text deltas never
contain an incomplete UTF-8 character or text that may turn out to start a stop string (held back
until it is clear); the last event carries whatever text is left, cut before the stop string.
Token ids and log-probs are sent as sampled. An engine without the hook streams each choice in one
event when it finishes. An engine failure mid-stream ends it with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from saorl.engines.base import EngineError, GenerationResult
from saorl.engines.serve import openai_api as oa
from saorl.engines.serve import openai_out as out
from saorl.engines.serve.chat_prompt import response_role
from saorl.engines.serve.generation import generate_all
from saorl.engines.serve.server_limits import error_body


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


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


class _Stream:
    """One streamed request: builds its events (module docstring)."""

    def __init__(self, state, req, prompts, work, chat: bool, rid: str) -> None:
        self.state, self.req, self.prompts, self.work = state, req, prompts, work
        self.chat, self.rid = chat, rid
        self.created = int(time.time())
        self.choices = [_Choice() for _ in work]
        so = req.stream_options
        self.usage = bool(so and so.include_usage)
        self.continuous = self.usage and bool(so.continuous_usage_stats)

    def event(self, choices: list[dict], **extra: Any) -> str:
        return _sse(out.chunk(self.state, self.chat, self.rid, self.created, choices, **extra))

    def opening(self) -> list[str]:
        """A chat stream's role events, one per choice."""
        if not self.chat:
            return []
        role, req = response_role(self.req), self.req
        events = []
        for i, (prompt, _) in enumerate(self.work):
            extra = dict(prompt_token_ids=self.prompts[0] if req.return_token_ids else None, prompt_text=None)
            if self.continuous:
                extra["usage"] = out.usage(len(prompt), 0, details=False)
            choice = dict(index=i, delta=dict(role=role, content=""), logprobs=None, finish_reason=None)
            events.append(self.event([choice], **extra))
        return events

    def piece(self, i: int, res: GenerationResult, upto: int, text: str, final: bool) -> str:
        """The event of choice ``i`` for its tokens ``[sent, upto)`` and ``text``."""
        state, req, c = self.state, self.req, self.choices[i]
        start, tok = c.sent_tokens, state.tokenizer
        new_ids = res.token_ids[start:upto]
        finish = res.finish_reason if final else None
        if self.chat:
            lp = out.chat_logprobs(tok, res, bool(req.return_tokens_as_token_ids), start, upto) \
                if req.logprobs and new_ids else None
            choice = dict(index=i, delta={"content": text}, logprobs=lp, finish_reason=finish)
            if final:
                choice["stop_reason"] = out.stop_reason(state, res)
        else:
            lp = out.completion_logprobs(tok, res, bool(req.return_tokens_as_token_ids), start, upto) \
                if req.logprobs is not None and new_ids else None
            first = start == 0 and not c.sent_chars
            choice = dict(index=i, text=text, logprobs=lp, finish_reason=finish,
                          stop_reason=out.stop_reason(state, res) if final else None,
                          prompt_token_ids=self.work[i][0] if first and req.return_token_ids else None)
        choice["token_ids"] = list(new_ids) if req.return_token_ids else None
        if state.emulate is None:
            choice["versions"] = res.versions[start:upto]
        c.sent_tokens = upto
        c.sent_chars += len(text)
        extra: dict[str, Any] = {}
        if self.continuous:
            extra["usage"] = out.usage(len(self.work[i][0]), upto, details=False)
        if final and not self.usage:
            extra["system_fingerprint"] = state.served.fingerprint
        return self.event([choice], **extra)

    def on_token(self, i: int, t: int, lp: float, v: int, alts) -> str | None:
        """Record choice ``i``'s new token; the event of its previous ones, if any were held."""
        c = self.choices[i]
        held = len(c.tokens)
        c.tokens.append(t)
        c.logprobs.append(lp)
        c.versions.append(v)
        if alts is not None:
            c.alts.append(alts)
        if held <= c.sent_tokens:
            return None
        text = ""
        if self.state.tokenizer is not None:
            shown = out.streamable_text(self.state.tokenizer, c.tokens[:held], self.req.stops(),
                                        self.req.skip_special_tokens)
            text = shown[c.sent_chars:]
        return self.piece(i, c.partial(), held, text, final=False)

    def closing(self, results: list[GenerationResult]) -> list[str]:
        req, events = self.req, []
        for i, (c, res) in enumerate(zip(self.choices, results)):
            final = out.response_text(self.state.tokenizer, res, req.include_stop_str_in_output,
                                      req.skip_special_tokens)
            events.append(self.piece(i, res, len(res.token_ids), final[c.sent_chars:], final=True))
        if self.usage:
            plen = sum(len(p) for p in self.prompts)
            use = out.usage(plen, sum(len(r.token_ids) for r in results), details=False)
            events.append(self.event([], usage=use, system_fingerprint=self.state.served.fingerprint))
        return events


async def stream_events(state, req, prompts: list[list[int]], work, chat: bool, rid: str,
                        started: float) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stream = _Stream(state, req, prompts, work, chat, rid)

    def hook(i: int):
        return lambda t, lp, v, alts: loop.call_soon_threadsafe(queue.put_nowait, ("tok", i, t, lp, v, alts))

    async def run() -> None:
        try:
            queue.put_nowait(("done", await generate_all(state, work, hook)))
        except Exception as e:  # reported in the stream: the status line is already sent
            queue.put_nowait(("error", e))

    for e in stream.opening():
        yield e
    task = asyncio.create_task(run())
    ended = False  # the stream's last event was produced: otherwise its client left
    try:
        while True:
            item = await queue.get()
            if item[0] == "tok":
                event = stream.on_token(*item[1:])
                if event is not None:
                    yield event
            elif item[0] == "done":
                results = item[1]
                state.metrics.record(sum(len(p) for p in prompts), results, time.monotonic() - started)
                ended = True
                for e in stream.closing(results):
                    yield e
                break
            else:
                e = item[1]
                code = 400 if isinstance(e, oa.BadRequest) else 503 if isinstance(e, EngineError) else 500
                says = str(e) if code != 500 else f"internal server error ({type(e).__name__})"
                ended = True
                yield _sse(error_body(code, says, getattr(e, "param", None)))
                break
        yield "data: [DONE]\n\n"
    finally:
        task.cancel()
        if not ended:
            state.metrics.abandoned(len(work))
