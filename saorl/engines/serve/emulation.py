"""Emulations of the vLLM and SGLang routes that saorl's clients use, driven by a local engine.

They exist so that :mod:`saorl.engines.clients.vllm_client` and
:mod:`saorl.engines.clients.sglang_client` (and a whole run with ``rollout.engine: vllm | sglang``)
are tested end to end on a CPU, against the same request and response schemas as the real servers
(the versions pinned in docs/engines.md). The engine must be a
:class:`~saorl.engines.local.LocalEngine`.

vLLM (``emulate="vllm"``; vLLM 0.32, dev-mode RL routes, ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /v1/completions``: the OpenAI route without saorl's extensions; ``token_ids`` only with
  ``return_token_ids``; ``cache_salt`` accepted; with an engine that records routes (the server's
  ``--enable-return-routed-experts``), every choice's ``routed_experts`` (base64 ``.npy``
  ``[positions, layers, k]``, as vLLM 0.32 sends them). ``logprobs_mode="raw_logprobs"`` (vLLM's default)
  returns log-probs of the *unprocessed* distribution (no temperature, no top-k/top-p), recomputed
  by a forward pass; ``"processed_logprobs"`` returns those of the distribution sampled from.
- ``POST /pause?mode=keep|wait|abort``, ``POST /resume``, ``GET /is_paused``: while paused, new
  requests wait; ``keep`` lets in-flight requests continue with the weights they meet (the engine
  applies an update between two decode steps, every token records the weights that sampled it);
  ``abort`` finishes them with ``finish_reason="abort"``.
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``: loads the
  safetensors files of a Hugging Face directory under the server's ``weights_dir``.
- ``POST /update_weight_version {"new_version": str}``, ``GET /weight_info``: the version label.

SGLang (``emulate="sglang"``; SGLang 0.5):

- ``POST /generate`` with ``input_ids`` (one prompt), ``sampling_params`` (``max_new_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``, ``sampling_seed``),
  ``return_logprob``, ``rid`` → ``text``, ``output_ids``, ``meta_info`` with ``id``,
  ``finish_reason {"type", "matched"}``, ``prompt_tokens``, ``completion_tokens``,
  ``output_token_logprobs`` (``[logprob, token_id, null]``), ``weight_version`` and
  ``weight_versions`` (spans ``{"version", "start", "end"}`` of output tokens per weight version);
  with ``return_routed_experts: true`` and an engine that records routes, ``routed_experts``
  (base64 int32 ``[positions, layers, k]``, as SGLang sends them; omitted otherwise, as SGLang does
  without ``--enable-return-routed-experts``).
- ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}``: ``abort`` returns every
  in-flight request at once with what it has (``finish_reason.type == "abort"``); new requests
  wait until ``POST /continue_generation``.
- ``POST /update_weights_from_disk {"model_path", "weight_version", "flush_cache", ...}``,
  ``GET /get_weight_version``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from saorl.engines.base import GenerationResult, SamplingParams
from saorl.engines.clients.routes import encode_flat
from saorl.engines.serve import openai_api as oa
from saorl.engines.serve import openai_out as out
from saorl.engines.serve.generation import read_json, unless_gone


class _Labels:
    """Version labels: the engine's int version of each load → the label the trainer gave it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.by_version: dict[int, str] = {engine.version: str(engine.version)}

    @property
    def current(self) -> str:
        return self.by_version.get(self.engine.version, str(self.engine.version))

    def set_current(self, label: str) -> None:
        self.by_version[self.engine.version] = label

    def spans(self, versions: list[int]) -> list[dict]:
        out: list[dict] = []
        for i, v in enumerate(versions):
            label = self.by_version.get(v, str(v))
            if out and out[-1]["version"] == label:
                out[-1]["end"] = i + 1
            else:
                out.append({"version": label, "start": i, "end": i + 1})
        return out


async def _load_dir(state, path: Any, what: str) -> None:
    """Load the Hugging Face model directory ``path`` (under ``weights_dir``) as the next version,
    the way the real servers read a checkpoint: by its on-disk names, converted to the model's."""
    real = state.allowed_path(path, what)
    if not (real / "config.json").is_file() or not any(real.glob("*.safetensors")):
        raise oa.BadRequest(f"{what}: {path!r} is not a Hugging Face model directory "
                            "(config.json and *.safetensors)", what)
    from safetensors import SafetensorError

    from saorl.models.hf_format import check_same_model
    from saorl.models.loading import load_policy
    from saorl.models.serialize import quiet_progress

    def load():
        check_same_model(real, state.engine.model)  # before load_policy allocates what config.json says
        with quiet_progress():
            return load_policy(str(real))

    own = state.engine.model.state_dict()
    try:
        loaded = await asyncio.to_thread(load)
        weights = {k: v for k, v in loaded.state_dict().items() if k in own}
        await asyncio.to_thread(state.engine.update_weights, weights, state.engine.version + 1)
    except (ValueError, OSError, SafetensorError) as e:
        raise oa.BadRequest(f"{what}: cannot load {path!r}: {e}", what) from None


async def _pause(state, mode: str) -> None:
    state.resumed.clear()
    if mode == "abort":  # returns once the aborted requests are answered, as the real servers do
        state.engine.abort_all()
        while state.running:
            await asyncio.sleep(0.005)
    elif mode == "wait":
        while state.pending:
            await asyncio.sleep(0.01)


def add_emulated_routes(app: FastAPI, state, *, logprobs_mode: str = "raw_logprobs") -> None:
    """The routes of the server ``state.emulation`` names (the row its ``emulate`` picked)."""
    emulation = state.emulation
    if emulation.logprobs_modes and logprobs_mode not in emulation.logprobs_modes:
        raise ValueError(f"logprobs_mode must be {' or '.join(emulation.logprobs_modes)}, "
                         f"got {logprobs_mode!r}")
    state.resumed = asyncio.Event()
    state.resumed.set()
    state.extras["labels"] = _Labels(state.engine)
    if emulation.logprobs_modes and logprobs_mode == "raw_logprobs":
        state.extras["postprocess"] = _raw_logprobs
    ROUTES[emulation.name](app, state)


# ------------------------------------------------------------------------------------- vLLM
async def _raw_logprobs(state, prompts, req, results: list[GenerationResult]) -> list[GenerationResult]:
    """vLLM's default ``raw_logprobs``: log-probs of the model's own distribution (T = 1, no
    truncation) for the sampled tokens, whatever the request sampled with."""
    from saorl.models.logprobs import token_logprobs

    def score(prompt: list[int], res: GenerationResult) -> list[float]:
        ids = torch.tensor([prompt + res.token_ids])
        with torch.inference_mode():
            lp = token_logprobs(state.engine.model, ids.to(state.engine.device), torch.ones_like(ids).to(
                state.engine.device))
        return lp[0, len(prompt):].tolist()

    out = []
    for i, res in enumerate(results):
        if not res.token_ids:
            out.append(res)
            continue
        raw = await asyncio.to_thread(score, prompts[i // req.n], res)
        out.append(GenerationResult(res.token_ids, raw, res.finish_reason, res.versions, res.stop_reason,
                                    res.metrics, res.top_logprobs, res.routes))
    return out


class _Rpc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    method: Literal["reload_weights"]
    kwargs: dict[Literal["weights_path", "is_checkpoint_format"], Any] = Field(default_factory=dict)
    args: list = Field(default_factory=list)
    timeout: float | None = None


def _vllm_routes(app: FastAPI, state) -> None:
    labels: _Labels = state.extras["labels"]

    @app.post("/pause")
    async def pause(mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
                    clear_cache: bool = True):
        await _pause(state, mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        state.resumed.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": not state.resumed.is_set()}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        rpc = oa.parse(_Rpc, await read_json(request))
        await _load_dir(state, rpc.kwargs.get("weights_path"), "kwargs.weights_path")
        return {"results": [None]}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_json(request)
        new = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(new, str) or not new:
            raise oa.BadRequest("new_version: expected a non-empty string", "new_version")
        labels.set_current(new)
        return {"success": True, "new_version": new}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": labels.current}


# ------------------------------------------------------------------------------------- SGLang
class _SglSampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    max_new_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    stop: oa.StopStr | list[oa.StopStr] | None = None
    stop_token_ids: list[oa.TokenId] | None = None
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True


class _SglGenerate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_ids: Annotated[list[oa.TokenId], Field(min_length=1)]
    sampling_params: _SglSampling = Field(default_factory=_SglSampling)
    return_logprob: bool = False
    return_routed_experts: bool = False
    rid: str | None = None
    stream: Literal[False] = False
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False


class _SglUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None
    abort_all_requests: bool = False


def _sglang_routes(app: FastAPI, state) -> None:
    labels: _Labels = state.extras["labels"]

    @app.post("/generate")
    async def generate(request: Request):
        req = oa.parse(_SglGenerate, await read_json(request))
        sp = req.sampling_params
        stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
                                max_new_tokens=sp.max_new_tokens, stop=stop,
                                stop_token_ids=tuple(sp.stop_token_ids or ()), seed=sp.sampling_seed)
        state.admit(1)
        try:
            await state.wait_resumed()
            state.running += 1
            try:
                res = await unless_gone(request, state.engine.agenerate(req.input_ids, params))
            except ValueError as e:
                raise oa.BadRequest(f"input_ids: {e}", "input_ids") from None
            finally:
                state.running -= 1
        finally:
            state.release(1)
        spans = labels.spans(res.versions)
        text = out.response_text(state.tokenizer, res, sp.no_stop_trim, sp.skip_special_tokens)
        meta: dict[str, Any] = dict(
            id=req.rid or out.new_id("sgl"),
            finish_reason={"type": res.finish_reason, "matched": res.stop_reason},
            prompt_tokens=len(req.input_ids), completion_tokens=len(res.token_ids),
            weight_version=spans[-1]["version"] if spans else labels.current, weight_versions=spans)
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(res.token_ids, res.logprobs)]
        if req.return_routed_experts and res.routes is not None:  # SGLang omits them without the flag
            meta["routed_experts"] = encode_flat(res.routes)
        return {"text": text, "output_ids": res.token_ids, "meta_info": meta}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_json(request) or {}
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            raise oa.BadRequest("mode: expected 'abort', 'retract' or 'in_place'", "mode")
        await _pause(state, mode)
        return {"status": "paused"}

    @app.post("/continue_generation")
    async def continue_generation():
        state.resumed.set()
        return {"status": "continued"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = oa.parse(_SglUpdate, await read_json(request))
        await _load_dir(state, req.model_path, "model_path")
        if req.weight_version is not None:
            labels.set_current(req.weight_version)
        return {"success": True, "message": f"loaded {Path(req.model_path).name}", "num_paused_requests": 0}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": labels.current}


ROUTES = {"vllm": _vllm_routes, "sglang": _sglang_routes}
"""The routes each row of :data:`saorl.engines.serve.emulated.EMULATIONS` adds (a test holds the
two to the same names)."""
