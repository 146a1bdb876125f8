"""One generation request inside the local engine: its state, its checks and its stop rule.

A :class:`Request` is what the engine thread keeps per sequence between its admission and its
delivery: the prompt, the sampling parameters, the tokens, log-probs and weight versions so far,
the prompt tokens still to feed (prefix reuse) and, with ``record_routes``, the MoE routes of
every fed position. :func:`validate_request` rejects bad input at the caller's thread, before
anything reaches the engine loop; :func:`finish_reason` is the stop rule checked after each
sampled token (the token is always kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from saorl.engines.base import FinishReason, GenerationResult, SamplingParams

Deliver = Callable[[Any], None]
OnToken = Callable[[int, float, int, "list[tuple[int, float]] | None"], None]
"""Called from the engine thread with (token id, log-prob, version, top alternatives or None) as
each token is sampled."""


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    deliver: Deliver
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    submitted: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: tuple[FinishReason, str | int | None] | None = None
    cancelled: bool = False
    on_token: OnToken | None = None
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    kv_version: int = -1
    """The weights version that computed this request's KV at its prefill."""
    feed: list[int] = field(default_factory=list)
    """Prompt tokens the next decode steps feed before this request samples (see ``_join``)."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """With ``record_routes``: ``[n, layers, k]`` chunks, the MoE routes of every position fed so far."""

    def result(self) -> GenerationResult:
        """The finished request as the caller receives it."""
        reason, stop = self.finish
        metrics = dict(prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens),
                       latency_s=time.perf_counter() - self.submitted)
        routes = fed_routes(self)
        return GenerationResult(list(self.tokens), list(self.logprobs), reason, list(self.versions), stop,
                                metrics, list(self.top) if self.params.top_logprobs else None,
                                None if routes is None else routes.flatten(1).tolist())


def fed_routes(r: Request) -> torch.Tensor | None:
    """``[positions fed, layers, k]``: the request's prompt and all its tokens but the last."""
    return torch.cat(r.routes) if r.routes else None


def validate_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_seq_len: int) -> None:
    """``TypeError`` / ``ValueError`` naming what is wrong with a request, before it is queued."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if not prompt:
        raise ValueError("prompt must contain at least one token id")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    if len(prompt) >= max_seq_len:
        raise ValueError(f"prompt has {len(prompt)} tokens; max_seq_len is {max_seq_len}")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise ValueError(f"stop must be a tuple of non-empty strings, got {params.stop!r}")
    bad = [t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be ints in [0, {vocab_size}), got {bad}")
    if params.session is not None and not isinstance(params.session, str):
        raise ValueError(f"session must be a string or None, got {params.session!r}")
    if params.seed is not None and not isinstance(params.seed, int):
        raise ValueError(f"seed must be an int or None, got {params.seed!r}")


def finish_reason(r: Request, tokenizer: Any, max_seq_len: int,
                  token: int) -> tuple[FinishReason, str | int | None] | None:
    """Why ``r`` stops after sampling ``token`` (its last token), or None to go on."""
    if r.cancelled:
        return ("abort", None)
    if token in r.stop_ids:
        return ("stop", token)
    if r.params.stop:
        longest = max(len(s) for s in r.params.stop)
        # a string of c chars spans at most 4c bytes, hence at most 4c byte-level tokens
        text = tokenizer.decode(r.tokens[-(4 * longest + 1) :], skip_special_tokens=False)
        hits = [(text.find(s), s) for s in r.params.stop if s in text]
        if hits:
            return ("stop", min(hits)[1])
    if len(r.tokens) >= r.params.max_new_tokens or len(r.prompt) + len(r.tokens) >= max_seq_len:
        return ("length", None)
    return None
