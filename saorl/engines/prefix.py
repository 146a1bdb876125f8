"""The local engine's per-session prefix store: KV rows kept between the turns of an episode.

A request with ``SamplingParams.session`` leaves, when it finishes, a copy of its KV row behind
(prompt + sampled tokens, all but the last, which was never fed to the model), keyed by the
session. When the session's next request arrives and its prompt extends those tokens (the agent
loop's next turn: context + sampled tokens + observation), only the new tokens are computed: at
most ``FEED_MAX_TOKENS`` of them are fed by the running batch's decode steps, more are prefilled
on top of the stored rows (several requests together, left-padded, then compacted,
:func:`saorl.engines.kv.compact`). Across a weight update, the engine's ``prefix_after_update``
decides:

- ``"keep"`` (the default): the rows survive updates, and the next turn continues on keys /
  values computed by older weights — exactly what a sequence in flight during an update does.
  Each token's log-prob is still that of the distribution it was drawn from, and ``versions``
  still names the weights that drew it; the older context is one more off-policy term for DIS to
  absorb. In an asynchronous run, where weights change every trainer step, this saves
  re-prefilling most contexts (docs/performance.md);
- ``"recompute"``: a stored row is used only if every one of its keys / values was computed by
  the current weights — a weight update drops the whole store, and a request during which
  weights changed leaves nothing behind — so every turn is sampled from the same distribution as
  after a full re-prefill (up to float rounding), and the turn after an update re-prefills its
  whole context with the new weights.

The store itself:

A finished request of session ``s`` leaves its KV row (:func:`saorl.engines.kv.row_kv`) behind,
with the tokens it covers and the weights version that computed it. The session's next request
takes it back if its prompt strictly extends those tokens and the weights have not changed since;
otherwise the row is dropped and the request is prefilled in full (the engine may waive the
version check: ``prefix_after_update="keep"``). Rows are held in LRU order up to a budget in
tokens (the oldest session's row goes first). The last turn of an episode leaves a row that no
request will take: the agent loops end their sessions (:func:`end_session`), which drops it at
once. Without that, every finished episode's last row would stay until evicted, and the store
would sit at its budget (65,536 tokens of SmolLM2-135M's float32 keys and values are 3 GB).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from saorl.engines.kv import RowKV

FEED_MAX_TOKENS = 8
"""A session request (an agent's turn) with at most this many new tokens — beyond its session's
stored row (the last sampled token and a short observation), or a short first prompt — joins the
running batch at once, and the decode steps feed those tokens one per step, sampling nothing
until the last. A forward of its own would cost about a whole decode step (on a CPU a small
forward is mostly fixed cost); a fed token costs one row of a decode step. Longer prompts, and
requests without a session, are prefilled in one forward."""


def new_token_inputs(prompts: list[list[int]], done: list[int], pad: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, L]`` ids, mask and position ids of each prompt's tokens after its first
    ``done[i]`` (those a stored row already holds); positions continue from ``done[i]``."""
    news = [p[n:] for p, n in zip(prompts, done)]
    length = max(map(len, news))
    ids = torch.full((len(news), length), pad, dtype=torch.long)
    mask = torch.zeros((len(news), length), dtype=torch.long)
    pos = torch.zeros((len(news), length), dtype=torch.long)
    for i, (n, new) in enumerate(zip(done, news)):
        ids[i, length - len(new):] = torch.tensor(new)
        mask[i, length - len(new):] = 1
        pos[i, length - len(new):] = torch.arange(n, n + len(new))
    return ids, mask, pos


def prefill_groups(pairs: list[tuple[Any, Prefix | None]], window: int | None
                   ) -> list[list[tuple[Any, Prefix | None]]]:
    """The prefill forwards of ``pairs`` (a request, its stored prefix or None): one, except for a
    model with sliding-window layers (``window``) whose rows extend stored prefixes by different
    numbers of tokens. Left-padded (:func:`new_token_inputs`), a shorter row's new tokens would sit
    columns apart from its past, and the model's window counts columns: each number of new tokens
    gets a forward of its own."""
    if not pairs or window is None or not any(e for _, e in pairs):
        return [pairs] if pairs else []
    groups: dict[int, list[tuple[Any, Prefix | None]]] = {}
    for r, e in pairs:
        groups.setdefault(len(r.prompt) - (len(e.tokens) if e else 0), []).append((r, e))
    return list(groups.values())


ENDED_KEPT = 4096
"""Ended sessions a :class:`PrefixStore` remembers, so that a late row of one is not kept."""


@dataclass
class Prefix:
    """One session's KV row: ``kv`` covers exactly ``tokens``, computed by weights ``version``."""

    tokens: list[int]
    kv: RowKV
    version: int
    routes: torch.Tensor | None = None
    """``[len(tokens), layers, k]`` MoE routes of those tokens, when the engine records them."""


def end_session(engine: Any, session: str) -> None:
    """Tell ``engine`` that ``session``'s episode is over, so it frees what it keeps for the
    session's next turn; engines that keep nothing (remote ones) have no ``end_session``."""
    end = getattr(engine, "end_session", None)
    if end is not None:
        end(session)


class PrefixStore:
    """Session id → :class:`Prefix`, LRU, at most ``budget_tokens`` tokens held (0 = off).

    Thread-safe: the engine's thread takes and keeps rows, an agent loop's drops them."""

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {budget_tokens}")
        self.budget = budget_tokens
        self._rows: OrderedDict[str, Prefix] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        """The last :data:`ENDED_KEPT` sessions dropped: a request of one still running when its
        episode ended (an agent past its deadline, a cancelled episode) leaves no row behind."""
        self._lock = threading.Lock()
        self.held = 0

    def __len__(self) -> int:
        return len(self._rows)

    def _pop(self, session: str) -> Prefix | None:
        entry = self._rows.pop(session, None)
        if entry is not None:
            self.held -= len(entry.tokens)
        return entry

    def take(self, session: str | None, prompt: list[int], version: int | None) -> Prefix | None:
        """The session's row if ``prompt`` strictly extends its tokens and ``version`` computed it
        (None: any version); the row leaves the store either way."""
        with self._lock:
            entry = None if session is None else self._pop(session)
        if entry is None:
            return None
        n = len(entry.tokens)
        stale = version is not None and entry.version != version
        if stale or n >= len(prompt) or prompt[:n] != entry.tokens:
            return None
        return entry

    def wants(self, session: str | None, tokens: int) -> bool:
        """Whether a row of ``tokens`` tokens for ``session`` would be kept at all."""
        return session is not None and 0 < tokens <= self.budget

    def keep(self, session: str, entry: Prefix) -> None:
        """Store ``entry`` for ``session`` (replacing its row), evicting the oldest over budget."""
        with self._lock:
            self._pop(session)
            if session in self._ended:
                return
            self._rows[session] = entry
            self.held += len(entry.tokens)
            while self.held > self.budget:
                _, dropped = self._rows.popitem(last=False)
                self.held -= len(dropped.tokens)

    def drop(self, session: str) -> bool:
        """Forget ``session``'s row (its episode is over), and keep none for it later; whether
        there was one."""
        with self._lock:
            self._ended[session] = None
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            return self._pop(session) is not None

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self.held = 0
