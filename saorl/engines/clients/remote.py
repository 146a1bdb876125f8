"""What the vLLM and SGLang clients share: the pooled transport, the version they believe the
servers run, and the administration steps a weight publisher drives.

A :class:`RemoteEngine` never pushes weights: the trainer's publisher
(:class:`saorl.runtime.weights.servers.ServerPublisher`) puts each version on every server (pause →
load from disk → label → resume) *before* it announces the version to the rollout workers, so
``update_weights(path, version)`` on a worker only records that the servers now run ``version``
(the fallback tag for tokens of a server that reports no version). A LoRA run announces adapter
directories: the client then names the newest one in every request, and a request naming one the
server has unloaded is sent again under the newest it has (:mod:`saorl.engines.clients.adapters`).

:class:`ServerAdmin` is one server's side of that publication; each client module implements it
with its server's own routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.engines.clients.adapters import adapter_name, is_missing_adapter, newest_loaded
from saorl.engines.clients.transport import HttpTransport, Routing
from saorl.models.adapter import is_adapter_dir


class ServerAdmin(Protocol):
    url: str

    async def pause(self) -> None:
        """Stop scheduling new work (what happens to requests in flight is the server's mode)."""
        ...

    async def load(self, hf_dir: str, version: int) -> None:
        """Load the Hugging Face model directory ``hf_dir`` and label the weights ``version``."""
        ...

    async def resume(self) -> None: ...


class RemoteEngine:
    """Base of the clients of servers that saorl does not run (see the module docstring)."""

    server_name = "server"

    def __init__(self, urls: str | Sequence[str], *, model: str | None = None, timeout_s: float = 600.0,
                 retries: int = 2, backoff_s: float = 0.5, max_connections: int = 256,
                 routing: Routing = "least_loaded") -> None:
        self.transport = HttpTransport(urls, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                       max_connections=max_connections, routing=routing)
        self.model = model
        self._version = 0
        self._stats: dict[str, float] = {"requests": 0, "tokens_generated": 0, "weight_updates": 0,
                                         "approximate_versions": 0, "adapter_retries": 0}
        self._adapter: tuple[int, str] | None = None
        """``(version, name)`` of the newest LoRA adapter announced (or found); None: the base model."""

    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, float]:
        return dict(self._stats) | {"version": self._version}

    def _count(self, res: GenerationResult) -> GenerationResult:
        self._stats["requests"] += 1
        self._stats["tokens_generated"] += len(res.token_ids)
        return res

    def _label_to_version(self, label) -> int:
        """A server's version label as saorl's int version; the believed one if it is not ours."""
        try:
            return int(label)
        except (TypeError, ValueError):
            return self._version

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        async def all_of() -> list[GenerationResult]:
            return list(await asyncio.gather(*(self.agenerate(p, params) for p in prompts)))

        return self.transport.run(all_of())

    def update_weights(self, weights: dict[str, torch.Tensor] | str, version: int) -> None:
        """Record that the servers now run ``version`` (the publisher has put it there); an adapter
        directory (a LoRA run) is named by every request after this call."""
        if isinstance(weights, str) and is_adapter_dir(weights):
            self._adapter = (int(version), adapter_name(weights))
        self._version = max(self._version, int(version))
        self._stats["weight_updates"] += 1

    async def _post_naming(self, path: str, url: str, adapter: tuple[int, str],
                           body: Callable[[tuple[int, str]], dict]) -> tuple[Any, tuple[int, str]]:
        """``POST path`` with ``body(adapter)`` to ``url``; a worker behind (the server has unloaded
        that adapter) sends it once more under the newest adapter the server has. Returns the
        answer and the ``(version, name)`` of the adapter it was sampled with."""
        try:
            return await self.transport.call("POST", path, body(adapter), url=url), adapter
        except EngineError as e:
            adapter = await self._newer_adapter(e, url, adapter[1])
            return await self.transport.call("POST", path, body(adapter), url=url), adapter

    async def _newer_adapter(self, error: EngineError, url: str, name: str) -> tuple[int, str]:
        """After ``error`` for a request naming the adapter ``name`` at ``url``: the newest adapter
        of this run that server has, now named by later requests too; ``error`` itself again when
        it was not a missing adapter or the server has no newer one
        (:mod:`saorl.engines.clients.adapters`)."""
        if not is_missing_adapter(error):
            raise error
        found = await newest_loaded(self.transport, url, name)
        if found is None:
            raise error
        self._stats["adapter_retries"] += 1
        if self._adapter is None or found[0] > self._adapter[0]:
            self._adapter = found
            self._version = max(self._version, found[0])
        return found

    def close(self) -> None:
        self.transport.close()
