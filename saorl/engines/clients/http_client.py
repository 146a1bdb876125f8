"""An :class:`InferenceEngine` that drives ``saorl serve`` over HTTP (pooled, async).

Requests go through one :class:`~saorl.engines.clients.transport.HttpTransport` (an ``httpx`` connection
pool on a private event loop), so a worker's hundreds of concurrent episodes are hundreds of
requests in flight, not a thread each. Several server URLs are spread round-robin or by least
load.

Wire format: ``POST /v1/completions`` (:mod:`saorl.engines.serve.openai_api`) with ``prompt`` as token
ids, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 when off), ``stop``,
``stop_token_ids``, ``seed``, ``logprobs: 0`` (the sampled token's log-prob only) and
``return_token_ids: true``. Read from ``choices[0]``: ``token_ids``, ``logprobs.token_logprobs``,
``finish_reason``, ``stop_reason``; per-token versions from saorl's extension
``saorl.versions`` (the server's engine records the weights that sampled each token).

Routing replay (``return_routes=True``): the request adds saorl's ``return_routed_experts: true``
and each choice answers ``routed_experts``, the MoE routes of every position the server fed (base64
of a ``.npy`` array ``[positions, layers, k]``, as vLLM sends them; :mod:`saorl.engines.clients.routes`). The
server must run with ``--enable-return-routed-experts``.

``update_weights(path, version)`` asks every server to load a safetensors file
(``POST /update_weights``): the server must have been started with ``--weights-dir`` at or above
that path on a disk it shares with this client. A state dict cannot be sent over HTTP.

vLLM and SGLang servers have clients of their own (:mod:`saorl.engines.clients.vllm_client`,
:mod:`saorl.engines.clients.sglang_client`); failures are :class:`EngineError` (see the transport).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import torch

from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.engines.clients.remote import RemoteEngine
from saorl.engines.clients.routes import RouteLayout, decode_routes
from saorl.engines.clients.transport import Routing


class HttpEngine(RemoteEngine):
    """Client for one or more ``saorl serve`` servers (see the module docstring). Unlike the other
    :class:`RemoteEngine` s, it puts each version on the servers itself (:meth:`update_weights`)."""

    server_name = "saorl serve"

    def __init__(self, base_url: str | Sequence[str], *, timeout_s: float = 60.0, retries: int = 2,
                 model: str | None = None, backoff_s: float = 0.2, max_connections: int = 256,
                 routing: Routing = "least_loaded", return_routes: bool = False,
                 route_layout: RouteLayout | None = None) -> None:
        super().__init__(base_url, model=model, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                         max_connections=max_connections, routing=routing)
        self.return_routes, self.route_layout = return_routes, route_layout
        self.base_url = self.transport.urls[0]

    def _body(self, prompt: list[int], p: SamplingParams) -> dict:
        body = dict(model=self.model, prompt=list(prompt), max_tokens=p.max_new_tokens,
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or -1, stop=list(p.stop),
                    stop_token_ids=list(p.stop_token_ids), logprobs=0, return_token_ids=True)
        if p.seed is not None:
            body["seed"] = p.seed
        if self.return_routes:
            body["return_routed_experts"] = True
        return body

    def _parse(self, out: dict) -> GenerationResult:
        try:
            choice = out["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            extra = out.get("saorl") or {}
            reported = extra.get("versions")
            if not reported and ids:
                self._stats["approximate_versions"] += 1
            versions = [int(v) for v in reported or [self._version] * len(ids)]
            if len(logprobs) != len(ids) or len(versions) != len(ids):
                raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs, {len(versions)} versions")
            return GenerationResult(ids, logprobs, choice["finish_reason"] or "abort", versions,
                                    choice.get("stop_reason"), dict(usage=out.get("usage", {})))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"malformed completion response from {self.base_url}: {e!r}: "
                              f"{str(out)[:300]}") from e

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        out = await self.transport.call("POST", "/v1/completions", self._body(prompt_ids, params))
        res = self._parse(out)
        if self.return_routes:
            where = f"{self.base_url}, choices[0].routed_experts"
            res.routes = decode_routes(out["choices"][0].get("routed_experts"), "npy",
                                       len(prompt_ids) + len(res.token_ids) - 1, where, self.route_layout)
        return self._count(res)

    def update_weights(self, weights: dict[str, torch.Tensor] | str, version: int) -> None:
        """Ask every server to load the safetensors file ``weights`` as ``version``."""
        if not isinstance(weights, str):
            raise EngineError("HttpEngine.update_weights takes the path of a safetensors file under the "
                              "server's --weights-dir; a state dict cannot be sent over HTTP")
        body = {"path": os.path.abspath(weights), "version": int(version)}

        async def every_server() -> None:
            await asyncio.gather(*(self.transport.call("POST", "/update_weights", body, url=u)
                                   for u in self.transport.urls))

        self.transport.run(every_server())
        self._version = int(version)
        self._stats["weight_updates"] += 1
