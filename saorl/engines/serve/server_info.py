"""The routes of ``saorl serve`` that say what is served, as vLLM 0.32's do.

- ``GET /v1/models``: one entry per served name (``id``, ``object``, ``created``, ``owned_by``:
  ``saorl``, ``root``: what the model was loaded from, ``parent``, ``max_model_len``,
  ``permission``).
- ``POST /tokenize``: ``{"prompt", "add_special_tokens"}`` or a chat request's ``messages`` (with
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``), each with
  ``return_token_strs``; answers ``count``, ``max_model_len``, ``tokens``, ``token_strs``: the ids
  the generation routes would feed the engine for the same input.
- ``POST /detokenize``: ``{"tokens"}`` → ``{"prompt"}``, special tokens kept (ids past the
  vocabulary are left out, as vLLM's tokenizer leaves them).
- ``GET /version``: ``{"version": <saorl's version>}`` — not vLLM's, so a client can tell; left out
  of the emulated vLLM (``--emulate vllm``), because saorl's vLLM client reads ``/version`` with
  ``/server_info`` to judge a real vLLM server, and the emulation has no ``/server_info``.
- ``GET /metrics``: Prometheus text (:mod:`saorl.engines.serve.server_metrics`).
- ``GET /health``: ``{"status": "ok", "version": <the engine's weight version>}`` (vLLM answers 200
  with an empty body).

Each request naming a model the server does not serve is a 404, as on the generation routes.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from saorl import __version__
from saorl.engines.serve import openai_api as oa
from saorl.engines.serve.chat_prompt import chat_prompt
from saorl.engines.serve.generation import json_response, off_loop, read_json
from saorl.engines.serve.server_metrics import CONTENT_TYPE


def _model_card(served, name: str) -> dict:
    permission = dict(id=f"modelperm-{uuid.uuid4().hex[:16]}", object="model_permission",
                      created=served.created, allow_create_engine=False, allow_sampling=True,
                      allow_logprobs=True,
                      allow_search_indices=False, allow_view=True, allow_fine_tuning=False, organization="*",
                      group=None, is_blocking=False)
    return dict(id=name, object="model", created=served.created, owned_by="saorl", root=served.root,
                parent=None, max_model_len=served.max_model_len, permission=[permission])


def _need_tokenizer(state) -> None:
    if state.tokenizer is None:
        raise oa.BadRequest("this server has no tokenizer (it takes and returns token ids only)")


def _tokenize(tok, req, chat: bool) -> tuple[list[int], list[str] | None]:
    ids = chat_prompt(tok, req) if chat else list(tok.encode(req.prompt,
                                                             add_special_tokens=req.add_special_tokens))
    return ids, (list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None)


def add_info_routes(app: FastAPI, state) -> None:
    served = state.served

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": state.engine.version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(served, n) for n in served.names]}

    if state.emulation is None or not state.emulation.own_version:
        @app.get("/version")
        async def version():
            return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(served.name, state.running, max(state.pending - state.running, 0),
                                    state.engine.version)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.post("/tokenize", openapi_extra=oa.request_body((oa.TokenizeCompletion, oa.TokenizeChat)))
    async def tokenize(request: Request):
        body = await read_json(request)
        chat = isinstance(body, dict) and "messages" in body
        req = oa.parse(oa.TokenizeChat if chat else oa.TokenizeCompletion, body)
        served.check(req.model)
        _need_tokenizer(state)
        size = len(await request.body())  # seconds of tokenizing for megabytes: off the event loop
        ids, strs = await off_loop(size, _tokenize, state.tokenizer, req, chat)
        return await json_response({"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids,
                                    "token_strs": strs}, 8 * len(ids))

    @app.post("/detokenize", openapi_extra=oa.request_body(oa.Detokenize))
    async def detokenize(request: Request):
        req = oa.parse(oa.Detokenize, await read_json(request))
        served.check(req.model)
        _need_tokenizer(state)
        known = [t for t in req.tokens if t < len(state.tokenizer)]
        return {"prompt": state.tokenizer.decode(known, skip_special_tokens=False)}
