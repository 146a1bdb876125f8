"""The local engine's per-session prefix store: KV rows kept between the turns of an episode.

A finished request of session ``s`` leaves its KV row (:func:`saorl.engines.kv.row_kv`) behind,
with the tokens it covers and the weights version that computed it. The session's next request
takes it back if its prompt strictly extends those tokens and the weights have not changed since;
otherwise the row is dropped and the request is prefilled in full (the engine may waive the
version check: ``prefix_after_update="keep"``). Rows are held in LRU order up to a budget in
tokens (the oldest session's row goes first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from saorl.engines.kv import RowKV


@dataclass
class Prefix:
    """One session's KV row: ``kv`` covers exactly ``tokens``, computed by weights ``version``."""

    tokens: list[int]
    kv: RowKV
    version: int


class PrefixStore:
    """Session id → :class:`Prefix`, LRU, at most ``budget_tokens`` tokens held (0 = off)."""

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {budget_tokens}")
        self.budget = budget_tokens
        self._rows: OrderedDict[str, Prefix] = OrderedDict()
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
        self._pop(session)
        self._rows[session] = entry
        self.held += len(entry.tokens)
        while self.held > self.budget:
            _, dropped = self._rows.popitem(last=False)
            self.held -= len(dropped.tokens)

    def clear(self) -> None:
        self._rows.clear()
        self.held = 0
