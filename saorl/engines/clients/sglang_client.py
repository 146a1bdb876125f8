"""The rollout engine for SGLang servers the user started (HTTP only; sglang is never imported).

Pinned to SGLang 0.5 (docs/engines.md has the launch command and which fields are used). Token ids
in, token ids, sampled-token log-probs and per-token weight versions out:

``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``,
``top_p``, ``top_k`` (-1 = off), ``stop``, ``stop_token_ids``, ``sampling_seed``),
``return_logprob: true`` and a fresh ``rid``. Read: ``output_ids``,
``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per output token),
``meta_info.finish_reason`` (``{"type": "stop" | "length" | "abort", "matched": ...}``) and the
weight versions: ``meta_info.weight_versions`` (spans ``{"version", "start", "end"}`` of output
tokens, exact per token) or, from servers without spans, ``meta_info.weight_version`` for the
whole chunk.

Abort mode. When the publisher pauses a server with ``mode: abort``, every request in flight comes
back at once with ``finish_reason.type == "abort"`` and the tokens it has. The client continues it:
it sends ``prompt + tokens so far`` as a new request with the remaining ``max_new_tokens`` (the
server waits until ``/continue_generation``, so the rest is sampled by the new weights) and
concatenates tokens, log-probs and versions chunk by chunk, up to ``max_continuations`` times. A
stop string split across two chunks is not seen by the server (each chunk checks its own output).

Routing replay (``return_routes=True``; the server runs with ``--enable-return-routed-experts``):
the request adds ``return_routed_experts: true`` and the answer's ``meta_info.routed_experts`` is
base64 of int32 ids ``[positions, layers, k]`` over every position the server fed, prompt and
output but the last token (:mod:`saorl.engines.clients.routes`, encoding ``flat``). A continued request
feeds the whole context again, so its last chunk's routes cover the whole result.

Weight publication (:class:`SglangAdmin`): ``POST /pause_generation {"mode"}`` →
``POST /update_weights_from_disk {"model_path": DIR, "weight_version": "<v>", "flush_cache"}`` →
``POST /continue_generation``.

LoRA adapters (a ``model.lora`` run; the server started with ``--enable-lora``, ``--max-lora-rank``
at least ``model.lora.rank``, ``--lora-target-modules`` covering the adapter's targets, and
``--max-loaded-loras`` unset or at least 3: the two kept plus the one being loaded). Nothing is
paused: the publisher loads each version's adapter directory under its own name
(:func:`saorl.engines.clients.adapters.adapter_name`) with ``POST /load_lora_adapter {"lora_name",
"lora_path"}`` and unloads old ones with ``POST /unload_lora_adapter {"lora_name"}``; both answer
``{"success", "error_message", "loaded_adapters"}`` (HTTP 400 when ``success`` is false). A worker
told of an adapter directory sends ``"lora_path": <name>`` with every ``/generate`` (SGLang
resolves it by name among the loaded adapters) and tags every token with that adapter's version,
exactly, whatever ``meta_info`` says. A request naming an unloaded adapter (HTTP 400, "The
following requested LoRA adapters are not loaded") is sent once more under the newest one ``GET
/v1/models`` lists (:mod:`saorl.engines.clients.adapters`). Written against SGLang 0.5's
``python/sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``
(``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``, ``GenerateReqInput.lora_path``) and
``lora/lora_registry.py``; not run against a real server here (no CPU build), only against a fake
of those routes (``tests/engines/clients/test_adapter_routes.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal

from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.engines.clients.remote import RemoteEngine
from saorl.engines.clients.routes import RouteLayout, decode_routes
from saorl.engines.clients.transport import HttpTransport

PauseMode = Literal["abort", "retract", "in_place"]


class SglangEngine(RemoteEngine):
    server_name = "SGLang"

    def __init__(self, urls: str | Sequence[str], *, max_continuations: int = 8, return_routes: bool = False,
                 route_layout: RouteLayout | None = None, **kw: Any) -> None:
        super().__init__(urls, **kw)
        if max_continuations < 0:
            raise ValueError(f"max_continuations must be >= 0, got {max_continuations}")
        self.max_continuations = max_continuations
        self.return_routes, self.route_layout = return_routes, route_layout
        self._stats["continuations"] = 0

    def _body(self, ids: list[int], p: SamplingParams, remaining: int) -> dict:
        sp: dict[str, Any] = dict(max_new_tokens=remaining, temperature=p.temperature, top_p=p.top_p,
                                  top_k=p.top_k or -1, stop=list(p.stop),
                                  stop_token_ids=list(p.stop_token_ids))
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        body = dict(input_ids=ids, sampling_params=sp, return_logprob=True, rid=uuid.uuid4().hex)
        if self._adapter is not None:
            body["lora_path"] = self._adapter[1]
        if self.return_routes:
            body["return_routed_experts"] = True
        return body

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for chunk in range(self.max_continuations + 1):
            remaining = params.max_new_tokens - len(tokens)
            body = self._body(list(prompt_ids) + tokens, params, remaining)
            adapter = self._adapter
            async with self.transport.lease() as url:
                if adapter is None:
                    out = await self.transport.call("POST", "/generate", body, url=url)
                else:
                    out, adapter = await self._post_naming("/generate", url, adapter,
                                                           lambda a, body=body: {**body, "lora_path": a[1]})
            ids, lps, vers, fin = self._parse(out, url)
            if adapter is not None:  # the adapter named is the version: exact
                vers = [adapter[0]] * len(ids)
            tokens += ids
            logprobs += lps
            versions += vers
            if chunk:
                self._stats["continuations"] += 1
            if fin.get("type") != "abort" or len(tokens) >= params.max_new_tokens:
                reason = fin.get("type") if fin.get("type") in ("stop", "length") else "length"
                routes = self._routes(out, len(prompt_ids) + len(tokens) - 1, url)
                return self._count(GenerationResult(tokens, logprobs, reason, versions, fin.get("matched"),
                                                    dict(chunks=chunk + 1), routes=routes))
        return self._count(GenerationResult(tokens, logprobs, "abort", versions, None,
                                            dict(chunks=self.max_continuations + 1)))

    def _routes(self, out: dict, positions: int, url: str) -> list[list[int]] | None:
        """The last chunk's routes (it fed the whole context), when the run replays them."""
        if not self.return_routes:
            return None
        meta = out.get("meta_info") if isinstance(out, dict) else None
        payload = meta.get("routed_experts") if isinstance(meta, dict) else None
        where = (f"SGLang at {url}, meta_info.routed_experts (start the server with "
                 "--enable-return-routed-experts)")
        return decode_routes(payload, "flat", positions, where, self.route_layout)

    def _parse(self, out: dict, url: str) -> tuple[list[int], list[float], list[int], dict]:
        try:
            meta = out["meta_info"]
            triples = meta["output_token_logprobs"]
            ids = [int(t) for t in (out.get("output_ids") or [t[1] for t in triples])]
            lps = [float(t[0]) for t in triples]
            if len(lps) != len(ids):
                raise ValueError(f"{len(ids)} output ids but {len(lps)} log-probs")
            spans = meta.get("weight_versions")
            if spans:
                vers = [self._version] * len(ids)
                for s in spans:
                    v = self._label_to_version(s["version"])
                    for i in range(int(s["start"]), min(int(s["end"]), len(ids))):
                        vers[i] = v
            else:
                vers = [self._label_to_version(meta.get("weight_version"))] * len(ids)
            return ids, lps, vers, meta.get("finish_reason") or {"type": "abort"}
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"malformed /generate response from SGLang at {url}: {e!r}: "
                              f"{str(out)[:300]}") from e


class SglangAdmin:
    """One SGLang server's side of a weight publication (see the module docstring)."""

    def __init__(self, url: str, transport: HttpTransport, mode: PauseMode = "abort") -> None:
        self.url, self.transport, self.mode = url.rstrip("/"), transport, mode

    async def pause(self) -> None:
        await self.transport.call("POST", "/pause_generation", {"mode": self.mode}, url=self.url)

    async def load(self, hf_dir: str, version: int) -> None:
        # the cache can be flushed only when nothing runs, which only abort mode guarantees
        body = {"model_path": hf_dir, "weight_version": str(version), "flush_cache": self.mode == "abort"}
        out = await self.transport.call("POST", "/update_weights_from_disk", body, url=self.url)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"SGLang at {self.url} refused the weights in {hf_dir}: {out.get('message')}")

    async def resume(self) -> None:
        await self.transport.call("POST", "/continue_generation", url=self.url)

    lora_route_hint = "update it to SGLang 0.5 and start it with --enable-lora"
    """What adds the adapter routes when the server answers them with FastAPI's own 404."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the adapter directory ``path`` (on the server's disk) under ``name``."""
        body = {"lora_name": name, "lora_path": path}
        await self._lora("/load_lora_adapter", body, f"load {path} as {name}")

    async def unload_adapter(self, name: str, *, missing_ok: bool = True) -> None:
        """Stop accepting requests that name ``name``; with ``missing_ok`` a name the server does not
        have is no error (SGLang: "LoRA with name … does not exist")."""
        try:
            await self._lora("/unload_lora_adapter", {"lora_name": name}, f"unload {name}")
        except EngineError as e:
            if not (missing_ok and f"LoRA with name {name} does not exist" in str(e)):
                raise

    async def _lora(self, path: str, body: dict, what: str) -> None:
        try:
            out = await self.transport.call("POST", path, body, url=self.url)
        except EngineError as e:  # SGLang answers a refusal with HTTP 400 and its error_message
            raise EngineError(f"SGLang at {self.url} could not {what}: {e}") from e
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"SGLang at {self.url} could not {what}: {out.get('error_message')}")
