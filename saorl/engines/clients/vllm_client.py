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
the check of the published versions verifies it (:mod:`saorl.runtime.weights.servers`).

Per-token versions. vLLM 0.32's completion response carries no weight version, so the client asks
the server's label (``GET /weight_info``, set by the publisher through
``POST /update_weight_version``) right before and right after the request. Equal labels: every
token was sampled by that version (the publisher labels while generation is paused). Different
labels: the request spanned an update and all its tokens are tagged with the older version — an
approximation that can only over-state staleness, counted in ``stats()["approximate_versions"]``.
The log-probs stay exact: vLLM 0.32's ``/pause?mode=keep`` preempts the running requests (it
clears the prefix cache) and recomputes their KV with the new weights after ``/resume``, so the
tokens after the update are the new version's (``tests/vllm/test_vllm_train.py`` checks it token
by token).

LoRA adapters (a ``model.lora`` run): the publisher loads each version's adapter directory on
every server under its own name (:func:`saorl.engines.clients.adapters.adapter_name`, ``POST
/v1/load_lora_adapter``; a server started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) before it announces the version. The announcement hands the
workers the directory, so ``update_weights`` knows the name; each request then names the newest
adapter as its ``model`` and its tokens carry that adapter's version, exactly: the server's weight
label is neither asked nor needed. A request naming an adapter the server has unloaded (a worker
two or more versions behind: HTTP 404, "does not exist") is sent once more under the newest adapter
of the run that ``GET /v1/models`` lists (:mod:`saorl.engines.clients.adapters`).

Routing replay (``return_routes=True``): a server started with ``--enable-return-routed-experts``
(vLLM 0.32 needs Model Runner V2 and prefix caching for it; there is no per-request switch) answers
every choice with ``routed_experts``: base64 of a ``.npy`` array ``[positions, layers, k]`` over
the prompt and the output but its last token (``CompletionResponseChoice.routed_experts`` in
``vllm/entrypoints/openai/completion/protocol.py``; :mod:`saorl.engines.clients.routes`, encoding ``npy``).

Weight publication (:class:`VllmAdmin`, dev-mode routes, ``VLLM_SERVER_DEV_MODE=1``):
``POST /pause?mode=keep`` (in-flight requests are kept and continue after ``/resume``),
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (reload from
the Hugging Face directory DIR on the server's disk; ``saorl_reload_weights`` on a CPU vLLM 0.32
server started with saorl's plugin, :data:`PLUGIN_FLAG`, which is exact for its MoE experts too),
``POST /update_weight_version {"new_version": "<v>"}``, ``POST /reset_prefix_cache`` (best
effort), ``POST /resume``. :meth:`VllmAdmin.describe` reads ``GET /version`` and ``GET
/server_info?config_format=json`` (device, dtype, log-prob mode, worker extension).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.engines.clients.remote import RemoteEngine
from saorl.engines.clients.routes import RouteLayout, decode_routes
from saorl.engines.clients.transport import HttpTransport


class VllmEngine(RemoteEngine):
    server_name = "vLLM"

    def __init__(self, urls, *, return_routes: bool = False, route_layout: RouteLayout | None = None,
                 **kw) -> None:
        super().__init__(urls, **kw)
        self.return_routes, self.route_layout = return_routes, route_layout

    async def _label(self, url: str) -> int:
        out = await self.transport.call("GET", "/weight_info", url=url)
        return self._label_to_version((out or {}).get("weight_version"))

    def _body(self, prompt: list[int], p: SamplingParams, version: int, model: str | None = None) -> dict:
        body = dict(prompt=list(prompt), max_tokens=p.max_new_tokens, temperature=p.temperature,
                    top_p=p.top_p, top_k=p.top_k or -1, stop=list(p.stop),
                    stop_token_ids=list(p.stop_token_ids),
                    logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True,
                    cache_salt=f"saorl-w{version}")
        if p.seed is not None:
            body["seed"] = p.seed
        if (model or self.model) is not None:
            body["model"] = model or self.model
        return body

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        adapter = self._adapter
        async with self.transport.lease() as url:
            if adapter is not None:  # the adapter named is the version: exact
                out, (version, _) = await self._post_naming(
                    "/v1/completions", url, adapter,
                    lambda a: self._body(prompt_ids, params, a[0], model=a[1]))
            else:
                before = await self._label(url)
                out = await self.transport.call("POST", "/v1/completions",
                                                self._body(prompt_ids, params, before), url=url)
                after = await self._label(url)
                if after != before:
                    self._stats["approximate_versions"] += 1
                version = min(before, after)
        res = self._parse(out, url, version)
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


PLUGIN_CLASS = "saorl_vllm.WeightReload"
PLUGIN_FLAG = f"--worker-extension-cls {PLUGIN_CLASS}"
"""The vLLM flag that loads saorl's worker extension (:mod:`saorl.engines.vllm_plugin.saorl_vllm`)."""


@dataclass(frozen=True)
class ServerInfo:
    """What a vLLM server says of itself (None where it does not say: an older build, an emulation)."""

    url: str
    version: str | None
    device: str | None
    """``cpu``, ``cuda``, ... (``device_config`` of ``GET /server_info``)."""
    dtype: str | None
    """``float32``, ``bfloat16``, ... (the model's dtype, same source)."""
    logprobs_mode: str | None
    """``processed_logprobs`` (what DIS needs), ``raw_logprobs`` (vLLM's default), ..."""
    plugin: bool
    """Whether the server was started with saorl's worker extension (:data:`PLUGIN_FLAG`)."""
    dev_mode: bool | None = None
    """Whether the development routes answer (``VLLM_SERVER_DEV_MODE=1``); None: not known."""
    max_lora_rank: int | None = None
    """``--max-lora-rank`` of a server started with ``--enable-lora``; 0: without it; None: not known."""
    lora_updates: bool | None = None
    """Whether adapters can be loaded at run time (the routes ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
    adds answer); None: not asked (a server without LoRA, or not known)."""

    @property
    def reload_method(self) -> str:
        """The plugin's reload on a CPU server (where vLLM's own one scrambles MoE experts), else
        vLLM's ``reload_weights``."""
        pinned = (self.version or "").startswith("0.32.")
        return "saorl_reload_weights" if self.plugin and self.device == "cpu" and pinned else "reload_weights"


def incompatibility(info: ServerInfo, *, moe: bool, processed: bool, dtype: str | None = None,
                    lora_rank: int | None = None) -> str | None:
    """Why the server of ``info`` cannot train a policy (``moe``: a Mixture-of-Experts one) whose
    sampling needs processed log-probs (``processed``: a temperature other than 1, or top-k /
    top-p) and whose trainer holds ``dtype`` (None: not compared), with LoRA adapters of rank
    ``lora_rank`` (None: full weights), or None."""
    url = info.url
    if info.dev_mode is False:
        return (f"the vLLM server at {url} answers, but not its development routes (/server_info, "
                "/collective_rpc), so no version could be put on it: restart it with "
                "VLLM_SERVER_DEV_MODE=1 in its environment")
    if lora_rank is not None:
        problem = lora_incompatibility(info, lora_rank, moe=moe)
        if problem:
            return problem
    mode = info.logprobs_mode
    if mode in ("raw_logits", "processed_logits"):
        return (f"the vLLM server at {url} runs --logprobs-mode {mode}, which returns logits, not "
                "log-probs; restart it with --logprobs-mode processed_logprobs")
    if processed and mode not in (None, "processed_logprobs"):
        return (f"the vLLM server at {url} returns {mode}, the log-probs of the model's "
                "own distribution, but the run samples with a temperature other than 1 or with top-k / "
                "top-p, so every DIS ratio would divide by the wrong probability. Restart it with "
                "--logprobs-mode processed_logprobs")
    if dtype is not None and info.dtype is not None and info.dtype != dtype:
        return (f"the vLLM server at {url} runs in {info.dtype} and the trainer in {dtype} "
                f"(model.dtype): the check of each version compares their log-probs with the {dtype} "
                f"tolerance and would stop the run. Restart the server with --dtype {dtype}, or set "
                "rollout.engine.verify_tol to the gap you accept (docs/engines.md has measured ones)")
    if moe and lora_rank is None and info.device == "cpu" and info.reload_method != "saorl_reload_weights":
        return (f"the vLLM server at {url} is a CPU build (vLLM {info.version or '?'}) and the policy "
                "is a Mixture-of-Experts model: vLLM's CPU build packs the expert weights once at load and "
                "its weight reload does not pack them again, so after the first publication it would "
                "sample from scrambled experts (measured: 0.13 nats per token off after reloading even "
                "the same weights) and training would be silently wrong. Restart the server (vLLM 0.32, "
                "for which the plugin is written) with saorl's plugin: "
                f'PYTHONPATH="$(saorl check-server --plugin-dir)" and {PLUGIN_FLAG} (docs/engines.md), '
                "or use a GPU server")
    return None


def lora_incompatibility(info: ServerInfo, rank: int, *, moe: bool = False) -> str | None:
    """Why the server of ``info`` cannot serve the adapters of rank ``rank`` a LoRA run publishes
    (``moe``: on a Mixture-of-Experts policy)."""
    if moe and info.device == "cpu":
        return (f"the vLLM server at {info.url} is a CPU build and the LoRA policy is a Mixture-of-Experts "
                "model: with --enable-lora, vLLM 0.32 runs MoE layers through its Triton fused-MoE "
                "kernels, which have no CPU backend, and the server's engine dies on its first request "
                "(measured: AttributeError: module 'triton.language' has no attribute 'float32'). Use a "
                "GPU server, rollout.engine=local, or model.lora.rank=null to publish full weights")
    flags = f"--enable-lora --max-lora-rank {lora_rank_flag(rank)} --max-loras 2"
    if info.max_lora_rank == 0:
        return (f"the vLLM server at {info.url} was started without --enable-lora, so it cannot load the "
                f"rank-{rank} LoRA adapter of each version (model.lora.rank={rank}): restart it with "
                f"{flags} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment")
    if info.max_lora_rank is not None and info.max_lora_rank < rank:
        return (f"the vLLM server at {info.url} accepts LoRA adapters up to rank {info.max_lora_rank} "
                f"(--max-lora-rank) and the run publishes rank {rank} (model.lora.rank): restart it with "
                f"--max-lora-rank {lora_rank_flag(rank)}, or lower model.lora.rank")
    if info.lora_updates is False:
        return (f"the vLLM server at {info.url} has LoRA on but does not load adapters at run time "
                "(its /v1/load_lora_adapter route is missing), so no version could be put on it: "
                "restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment")
    return None


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``--max-lora-rank``."""


def lora_rank_flag(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds adapters of rank ``rank``."""
    return next((r for r in _LORA_RANKS if r >= rank), rank)


class VllmAdmin:
    """One vLLM server's side of a weight publication (see the module docstring)."""

    lora_route_hint = ("restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment "
                       "(and --enable-lora)")
    """What adds the adapter routes when the server answers them with FastAPI's own 404."""

    def __init__(self, url: str, transport: HttpTransport) -> None:
        self.url, self.transport = url.rstrip("/"), transport
        self.info: ServerInfo | None = None

    async def describe(self) -> ServerInfo:
        """The server's version, device, dtype, log-prob mode and whether saorl's plugin is loaded
        (``GET /version``, ``GET /server_info?config_format=json``); remembered, and :meth:`load`
        then uses the plugin's reload on a CPU vLLM 0.32 server that has it
        (:attr:`ServerInfo.reload_method`). Read-only: an RPC to a method the worker
        lacks would kill vLLM's engine, so the plugin is found in the config, never called."""
        async def get(path: str, **params) -> dict:
            try:
                out = await self.transport.call("GET", path, url=self.url, params=params or None)
            except EngineError as e:
                if "HTTP 404" in str(e):
                    return {}
                raise
            return out if isinstance(out, dict) else {}

        version = (await get("/version")).get("version")
        info = await get("/server_info", config_format="json")
        config = info.get("vllm_config")
        config = config if isinstance(config, dict) else {}
        model = config.get("model_config") or {}
        dtype = model.get("dtype")
        self.info = ServerInfo(
            self.url, version, (config.get("device_config") or {}).get("device"),
            str(dtype).removeprefix("torch.") if dtype else None, model.get("logprobs_mode"),
            (config.get("parallel_config") or {}).get("worker_extension_cls") == PLUGIN_CLASS,
            dev_mode=None if version is None else bool(info), **await self._lora(config))
        return self.info

    async def _lora(self, config: dict) -> dict:
        """``max_lora_rank`` (``lora_config`` of ``/server_info``: null without ``--enable-lora``) and,
        with LoRA on, ``lora_updates``: whether the run-time routes are there, asked by unloading a
        name no adapter has (vLLM answers that name "cannot be found"; without the routes the path is
        not found)."""
        if not config:
            return {}
        lora = config.get("lora_config")
        if not isinstance(lora, dict):
            return {"max_lora_rank": 0}
        try:
            await self.unload_adapter("saorl-probe-no-such-adapter", missing_ok=False)
        except EngineError as e:
            if "HTTP 404" not in str(e):
                raise
            return {"max_lora_rank": int(lora.get("max_lora_rank") or 0),
                    "lora_updates": "cannot be found" in str(e)}
        return {"max_lora_rank": int(lora.get("max_lora_rank") or 0), "lora_updates": True}

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the adapter directory ``path`` (on the server's disk) under ``name``."""
        await self.transport.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                  url=self.url, text=True)

    async def unload_adapter(self, name: str, *, missing_ok: bool = True) -> None:
        """Stop accepting requests that name ``name``; requests already running finish with it."""
        try:
            await self.transport.call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, url=self.url,
                                      text=True)
        except EngineError as e:
            if not (missing_ok and "cannot be found" in str(e)):
                raise

    async def pause(self) -> None:
        await self.transport.call("POST", "/pause", url=self.url, params={"mode": "keep"})

    async def load(self, hf_dir: str, version: int) -> None:
        info = self.info or await self.describe()
        body = {"method": info.reload_method, "kwargs": {"weights_path": hf_dir}}
        await self.transport.call("POST", "/collective_rpc", body, url=self.url)
        label = {"new_version": str(version)}
        await self.transport.call("POST", "/update_weight_version", label, url=self.url)
        # Prefix KV of the old weights is never reused within a run (each request's cache_salt
        # names its version); dropping it also covers a new run that starts its versions at 0
        # on a server an earlier run used. vLLM refuses while requests hold blocks; best effort.
        with contextlib.suppress(EngineError):
            await self.transport.call("POST", "/reset_prefix_cache", url=self.url)

    async def resume(self) -> None:
        await self.transport.call("POST", "/resume", url=self.url)
