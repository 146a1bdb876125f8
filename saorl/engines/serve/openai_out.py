"""The responses of ``saorl serve``'s OpenAI routes, key for key as vLLM 0.32 writes them.

A completion response holds ``id``, ``object``, ``created``, ``model`` (the first served name,
whatever alias the request used), ``choices``, ``service_tier``, ``system_fingerprint``, ``usage``
(``prompt_tokens``, ``total_tokens``, ``completion_tokens``, ``prompt_tokens_details``,
``completion_tokens_details``), ``kv_transfer_params``, ``ec_transfer_params`` and ``metrics``; a
chat response adds ``prompt_logprobs``, ``prompt_token_ids`` and ``prompt_text``. Fields saorl has
no value for are null, as on a vLLM server without the feature. Each completion choice: ``index``,
``text``, ``logprobs``, ``finish_reason``, ``stop_reason``, ``token_ids``, ``prompt_logprobs``,
``prompt_token_ids``, ``routed_experts``; each chat choice: ``index``, ``message`` (``role``,
``content``, ``refusal``, ``annotations``, ``audio``, ``function_call``, ``reasoning``),
``logprobs``, ``finish_reason``, ``stop_reason``, ``token_ids``, ``routed_experts``.

Usage is counted as vLLM counts it: each prompt's tokens once, however many choices it has (``n``),
and every sampled token of every choice, the stop token included. ``stop_reason`` is the stop
string or stop token id that ended the choice, and null when it ended at the tokenizer's EOS, at
``max_tokens`` or by an abort. Log-probs are floored at -9999 (JSON has no -inf). Completions
``top_logprobs`` hold the sampled token and the k most likely ones (up to k + 1 entries, as vLLM
and OpenAI); chat ``top_logprobs`` hold the k most likely.

Stop strings. The engine keeps every sampled token (``token_ids`` and the log-probs report exactly
what was sampled, the last token may run past the stop string); the returned *text* ends before
the stop string, as OpenAI and vLLM do (``include_stop_str_in_output: true`` keeps it). A stream
holds back text that could still turn out to be the start of a stop string.

saorl's extension (not with ``--emulate``): each choice's ``versions`` (the weight version of each
token) and the response's ``saorl: {"versions", "engine_version"}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from saorl.engines.base import GenerationResult

FLOOR = -9999.0


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex[:16]}"


def floor(lp: float) -> float:
    return max(lp, FLOOR)


# ------------------------------------------------------------------------------------- text
def response_text(tokenizer, res: GenerationResult, include_stop: bool, skip_special: bool = True) -> str:
    """The completion's text: decoded (without special tokens unless ``skip_special`` is off),
    ending before the stop string that finished it (or right after it with ``include_stop``)."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(res.token_ids, skip_special_tokens=skip_special)
    if res.finish_reason == "stop" and isinstance(res.stop_reason, str):
        at = text.find(res.stop_reason)
        if at >= 0:
            text = text[: at + (len(res.stop_reason) if include_stop else 0)]
    return text


def streamable_text(tokenizer, tokens: list[int], stops: tuple[str, ...], skip_special: bool = True) -> str:
    """The part of the decoded ``tokens`` that can be sent before the request ends: without a
    trailing incomplete UTF-8 character, and holding back what could be a stop string's start."""
    text = tokenizer.decode(tokens, skip_special_tokens=skip_special).rstrip("\ufffd")
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[: min(hits)]
    hold = max((len(s) - 1 for s in stops), default=0)
    return text[: len(text) - hold] if hold else text


def token_str(tokenizer, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids or tokenizer is None else tokenizer.decode([token])


# ------------------------------------------------------------------------------------- logprobs
def completion_logprobs(tokenizer, res: GenerationResult, as_ids: bool, start: int = 0,
                        end: int | None = None) -> dict:
    """OpenAI completions ``logprobs`` for ``res``'s tokens ``[start, end)``."""
    ids, lps = res.token_ids[start:end], res.logprobs[start:end]
    tokens = [token_str(tokenizer, t, as_ids) for t in ids]
    alts = res.top_logprobs[start:end] if res.top_logprobs is not None else [[] for _ in ids]
    top = []
    for t, lp, step in zip(tokens, lps, alts):
        entry = {t: floor(lp)}
        for a, alp in step:
            entry.setdefault(token_str(tokenizer, a, as_ids), floor(alp))
        top.append(entry)
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return dict(text_offset=offsets, token_logprobs=[floor(x) for x in lps], tokens=tokens, top_logprobs=top)


def chat_logprobs(tokenizer, res: GenerationResult, as_ids: bool, start: int = 0,
                  end: int | None = None) -> dict:
    """OpenAI chat ``logprobs.content`` for ``res``'s tokens ``[start, end)``."""
    def entry(t: int, lp: float) -> dict:
        s = token_str(tokenizer, t, as_ids)
        return dict(token=s, logprob=floor(lp), bytes=list(s.encode("utf-8", errors="replace")))

    content = []
    for i in range(start, len(res.token_ids) if end is None else end):
        e = entry(res.token_ids[i], res.logprobs[i])
        alts = res.top_logprobs[i] if res.top_logprobs is not None else []
        e["top_logprobs"] = [entry(a, lp) for a, lp in alts]
        content.append(e)
    return dict(content=content)


# ------------------------------------------------------------------------------------- choices
def stop_reason(state, res: GenerationResult) -> str | int | None:
    """vLLM's ``stop_reason``: null for the EOS the engine stops on by itself."""
    if res.finish_reason == "stop" and res.stop_reason == state.served.eos_token_id:
        return None
    return res.stop_reason if res.finish_reason == "stop" else None


def completion_choice(state, req, i: int, res: GenerationResult, prompt: list[int]) -> dict:
    lps = None if req.logprobs is None else completion_logprobs(
        state.tokenizer, res, bool(req.return_tokens_as_token_ids))
    routes = None
    if state.route_layout is not None and (req.return_routed_experts or (
            state.emulation is not None and state.emulation.routes_always)):
        from saorl.engines.clients.routes import encode_npy

        routes = encode_npy(res.routes, state.route_layout.layers, state.route_layout.experts)
    choice = dict(index=i, text=response_text(state.tokenizer, res, req.include_stop_str_in_output,
                                              req.skip_special_tokens),
                  logprobs=lps, finish_reason=res.finish_reason, stop_reason=stop_reason(state, res),
                  token_ids=list(res.token_ids) if req.return_token_ids else None, prompt_logprobs=None,
                  prompt_token_ids=list(prompt) if req.return_token_ids else None, routed_experts=routes)
    if state.emulate is None:
        choice["versions"] = res.versions
    return choice


def message(role: str, content: str) -> dict:
    return dict(role=role, content=content, refusal=None, annotations=None, audio=None, function_call=None,
                reasoning=None)


def chat_choice(state, req, i: int, res: GenerationResult, role: str) -> dict:
    text = response_text(state.tokenizer, res, req.include_stop_str_in_output, req.skip_special_tokens)
    lps = chat_logprobs(state.tokenizer, res, bool(req.return_tokens_as_token_ids)) if req.logprobs else None
    choice = dict(index=i, message=message(role, text), logprobs=lps, finish_reason=res.finish_reason,
                  stop_reason=stop_reason(state, res),
                  token_ids=list(res.token_ids) if req.return_token_ids else None, routed_experts=None)
    if state.emulate is None:
        choice["versions"] = res.versions
    return choice


# ------------------------------------------------------------------------------------- envelopes
def usage(prompt_tokens: int, completion_tokens: int, details: bool = True) -> dict:
    out = dict(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + completion_tokens,
               completion_tokens=completion_tokens)
    if details:
        out |= dict(prompt_tokens_details=None, completion_tokens_details=None)
    return out


def response(state, chat: bool, rid: str, choices: list[dict], use: dict,
             prompt_ids: list[int] | None = None) -> dict:
    """The whole (non-streaming) response body; ``prompt_ids`` for a chat request's ``return_token_ids``."""
    out = dict(id=rid, object="chat.completion" if chat else "text_completion", created=int(time.time()),
               model=state.served.name, choices=choices, service_tier=None,
               system_fingerprint=state.served.fingerprint, usage=use)
    if chat:
        out |= dict(prompt_logprobs=None, prompt_token_ids=prompt_ids, prompt_text=None)
    return out | dict(kv_transfer_params=None, ec_transfer_params=None, metrics=None)


def chunk(state, chat: bool, rid: str, created: int, choices: list[dict], **extra: Any) -> dict:
    """One streamed event (``extra``: ``usage``, ``system_fingerprint``, a chat stream's first
    ``prompt_token_ids`` / ``prompt_text``)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return dict(id=rid, object=kind, created=created, model=state.served.name, choices=choices, **extra)


def with_extension(state, out: dict, results: list[GenerationResult]) -> dict:
    if state.emulate is None:
        out["saorl"] = dict(versions=results[0].versions, engine_version=state.engine.version)
    return out
