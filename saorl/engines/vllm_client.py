"""The rollout engine for vLLM servers the user started (HTTP only; vllm is never imported).

Pinned to vLLM 0.32.0 (docs/engines.md has the launch command and which fields are used). Token
ids in, token ids and sampled-token log-probs out, no re-tokenization:

``POST /v1/completions`` with ``prompt`` = the token ids, ``max_tokens``, ``temperature``,
``top_p``, ``top_k`` (-1 = off), ``stop``, ``stop_token_ids``, ``seed``, ``logprobs: 0`` (only the
sampled token's log-prob), ``return_token_ids: true``, ``return_tokens_as_token_ids: true`` and
``cache_salt: "saorl-w<version>"`` so that no request reuses prefix KV computed by older weights.
Read: ``choices[0].token_ids`` (else the ids in ``logprobs.tokens``, ``"token_id:<id>"``),
``logprobs.token_logprobs``, ``finish_reason``, ``stop_reason``. The log-probs are those of the
distribution sampled from only when the server runs with ``--logprobs-mode processed_logprobs``;
the run's start-up probe checks it (:mod:`saorl.runtime.publisher`).

Per-token versions. vLLM 0.32's completion response carries no weight version, so the client asks
the server's label (``GET /weight_info``, set by the publisher through
``POST /update_weight_version``) right before and right after the request. Equal labels: every
token was sampled by that version (the publisher labels while generation is paused). Different
labels: the request spanned an update and all its tokens are tagged with the older version — an
approximation that can only over-state staleness, counted in ``stats()["approximate_versions"]``.

Routing replay (``return_routes=True``): a server started with ``--enable-return-routed-experts``
(vLLM 0.32 needs Model Runner V2 and prefix caching for it; there is no per-request switch) answers
every choice with ``routed_experts``: base64 of a ``.npy`` array ``[positions, layers, k]`` over
the prompt and the output but its last token (``CompletionResponseChoice.routed_experts`` in
``vllm/entrypoints/openai/completion/protocol.py``; :mod:`saorl.engines.routes`, encoding ``npy``).

Weight publication (:class:`VllmAdmin`, dev-mode routes, ``VLLM_SERVER_DEV_MODE=1``):
``POST /pause?mode=keep`` (in-flight requests are kept and continue after ``/resume``),
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (reload from
the Hugging Face directory DIR on the server's disk), ``POST /update_weight_version
{"new_version": "<v>"}``, ``POST /resume``.
"""

from __future__ import annotations

from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.engines.remote import RemoteEngine
from saorl.engines.routes import RouteLayout, decode_routes
from saorl.engines.transport import HttpTransport


class VllmEngine(RemoteEngine):
    server_name = "vLLM"

    def __init__(self, urls, *, return_routes: bool = False, route_layout: RouteLayout | None = None,
                 **kw) -> None:
        super().__init__(urls, **kw)
        self.return_routes, self.route_layout = return_routes, route_layout

    async def _label(self, url: str) -> int:
        out = await self.transport.call("GET", "/weight_info", url=url)
        return self._label_to_version((out or {}).get("weight_version"))

    def _body(self, prompt: list[int], p: SamplingParams, version: int) -> dict:
        body = dict(prompt=list(prompt), max_tokens=p.max_new_tokens, temperature=p.temperature,
                    top_p=p.top_p, top_k=p.top_k or -1, stop=list(p.stop),
                    stop_token_ids=list(p.stop_token_ids),
                    logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True,
                    cache_salt=f"saorl-w{version}")
        if p.seed is not None:
            body["seed"] = p.seed
        if self.model is not None:
            body["model"] = self.model
        return body

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        async with self.transport.lease() as url:
            before = await self._label(url)
            out = await self.transport.call("POST", "/v1/completions", self._body(prompt_ids, params, before),
                                            url=url)
            after = await self._label(url)
        if after != before:
            self._stats["approximate_versions"] += 1
        res = self._parse(out, url, min(before, after))
        if self.return_routes:
            where = (f"vLLM at {url}, choices[0].routed_experts (start the server with "
                     "--enable-return-routed-experts)")
            res.routes = decode_routes(out["choices"][0].get("routed_experts"), "npy",
                                       len(prompt_ids) + len(res.token_ids) - 1, where, self.route_layout)
        return self._count(res)

    def _parse(self, out: dict, url: str, version: int) -> GenerationResult:
        try:
            choice = out["choices"][0]
            lp = choice["logprobs"]
            ids = choice.get("token_ids")
            if ids is None:
                ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            ids = [int(t) for t in ids]
            logprobs = [float(x) for x in lp["token_logprobs"]]
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(ids)} token ids but {len(logprobs)} log-probs")
            return GenerationResult(ids, logprobs, choice.get("finish_reason") or "abort",
                                    [version] * len(ids), choice.get("stop_reason"),
                                    dict(usage=out.get("usage", {}), server=url))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"malformed completion response from vLLM at {url}: {e!r}: "
                              f"{str(out)[:300]}") from e


class VllmAdmin:
    """One vLLM server's side of a weight publication (see the module docstring)."""

    def __init__(self, url: str, transport: HttpTransport) -> None:
        self.url, self.transport = url.rstrip("/"), transport

    async def pause(self) -> None:
        await self.transport.call("POST", "/pause", url=self.url, params={"mode": "keep"})

    async def load(self, hf_dir: str, version: int) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": hf_dir}}
        await self.transport.call("POST", "/collective_rpc", body, url=self.url)
        label = {"new_version": str(version)}
        await self.transport.call("POST", "/update_weight_version", label, url=self.url)

    async def resume(self) -> None:
        await self.transport.call("POST", "/resume", url=self.url)
