"""``saorl serve``'s HTTP server: an :class:`InferenceEngine` behind vLLM 0.32's OpenAI-compatible API.

FastAPI on uvicorn. Each request is a coroutine that awaits ``engine.agenerate``, so concurrent
requests meet in the engine's continuous batch. Routes: ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (requests: :mod:`saorl.engines.serve.openai_api`,
:mod:`~saorl.engines.serve.chat_prompt`; responses, key for key as vLLM's:
:mod:`saorl.engines.serve.openai_out`; SSE: :mod:`saorl.engines.serve.streaming`), ``GET
/v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /metrics``
(Prometheus), ``GET /health`` (:mod:`saorl.engines.serve.server_info`), and saorl's ``POST
/update_weights``; with ``emulate="vllm"`` or ``"sglang"`` the routes of those servers that saorl's
clients use (:mod:`saorl.engines.serve.emulation`). What is served is a
:class:`~saorl.engines.serve.served.ServedModel`: its names (a request naming another model is a
404, as in vLLM), context length and ``generation_config.json`` defaults.

saorl's extension: each choice carries ``versions`` (the weight version that sampled each token) and
the response ``saorl: {"versions": <choice 0's>, "engine_version": v}``; emulated servers leave them
out, as the real ones do. With an engine that records MoE routes (``saorl serve
--enable-return-routed-experts``), a completion request with ``return_routed_experts: true`` gets
each choice's ``routed_experts`` (base64 ``.npy``, :mod:`saorl.engines.clients.routes`); an emulated vLLM
server sends them with every choice, as vLLM does.

Holding load: every limit is a :class:`ServerLimits` field and a ``saorl serve`` option, and every
refusal a JSON error naming its limit (:mod:`saorl.engines.serve.server_limits`: the header and body
deadlines, the body size, the JSON nesting depth). Here: at most ``max_pending`` generations
admitted at once (running or waiting for an engine slot; a request with ``n`` choices counts ``n``
per prompt); past it, 503 with ``Retry-After``, unless the request alone asks for more than
``max_pending``, which no wait would let in: that is a 400. Malformed fields get 400 naming the
field (strict validation, finite numbers only); an exception no handler expected is a JSON 500.

Weight updates (``POST /update_weights {"path", "version"}``) are off unless the server is given
``weights_dir``; then only files under that directory (after resolving links) are loaded, and a
path outside it is refused without looking at it, so the endpoint reveals nothing about other
paths. A path that is not one (a NUL byte), a file that is not weights (garbage, text, another
model's) and a load that fails are 400s saying why; the old weights stay. Errors are
``{"error": {"message", "type", "param", "code"}}`` (``type`` as vLLM names it); engine failures
are 503.

``create_app(...).openapi()`` is the OpenAPI document, request bodies included (the routes read their
bodies themselves, to answer 400s in this shape); it is not served (no docs routes), and the tests
fuzz the server from it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from saorl.engines.base import EngineError, InferenceEngine
from saorl.engines.serve import openai_api as oa
from saorl.engines.serve import openai_out as out
from saorl.engines.serve.chat_prompt import chat_prompt, response_role
from saorl.engines.serve.emulated import emulation_of
from saorl.engines.serve.generation import (
    ClientGone,
    encode_texts,
    generate_all,
    json_response,
    off_loop,
    plan,
    read_json,
    unless_gone,
)
from saorl.engines.serve.served import ServedModel
from saorl.engines.serve.server_info import add_info_routes
from saorl.engines.serve.server_limits import (
    BodyLimit,
    HeaderDeadline,
    Overloaded,
    ServerLimits,
    error_response,
)
from saorl.engines.serve.server_metrics import ServerMetrics

Emulate = str | None
"""A name of :data:`saorl.engines.serve.emulated.EMULATIONS`, or None."""


@dataclass
class ServerState:
    engine: InferenceEngine
    tokenizer: Any
    served: ServedModel
    limits: ServerLimits
    weights_dir: Path | None
    emulate: Emulate
    pending: int = 0
    running: int = 0
    """Requests the engine is working on now (admitted ones waiting for a resume are not)."""
    resumed: asyncio.Event | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)

    def __post_init__(self) -> None:
        self.emulation = emulation_of(self.emulate)
        params = inspect.signature(self.engine.agenerate).parameters
        self.streams = "on_token" in params
        self.route_layout = None
        if getattr(self.engine, "records_routes", False):
            from saorl.engines.clients.routes import RouteLayout
            from saorl.models import routing

            model = self.engine.model
            self.route_layout = RouteLayout(routing.num_moe_layers(model), routing.num_experts(model))

    def admit(self, need: int) -> None:
        """Count ``need`` more generations in: 503 while too many run, 400 if they never could."""
        if need > self.limits.max_pending:
            raise oa.BadRequest(f"n: the request asks for {need} generations at once (prompts x n), "
                                f"more than the {self.limits.max_pending} this server ever admits "
                                "(--max-pending); send it in smaller pieces", "n")
        if self.pending + need > self.limits.max_pending:
            raise Overloaded(f"{self.pending} generations in flight; the limit is {self.limits.max_pending}")
        self.pending += need

    def release(self, need: int) -> None:
        self.pending -= need

    async def wait_resumed(self) -> None:
        if self.resumed is not None:
            await self.resumed.wait()

    def allowed_path(self, path: Any, what: str = "path") -> Path:
        """``path`` resolved, if it lies under ``weights_dir`` (403 otherwise, without touching it)."""
        if self.weights_dir is None:
            raise PermissionError("weight updates are disabled: start the server with --weights-dir DIR "
                                  "to load weights from files under DIR")
        if not isinstance(path, str) or not path:
            raise oa.BadRequest(f"{what}: expected a non-empty string path", what)
        if "\0" in path:
            raise oa.BadRequest(f"{what}: a path cannot hold a NUL byte", what)
        real = Path(os.path.realpath(path))
        if real != self.weights_dir and self.weights_dir not in real.parents:
            raise PermissionError(f"{what} must lie under the server's weights directory")
        if not os.path.exists(real):  # False for a name too long as well (Path.exists raises)
            raise oa.BadRequest(f"{what}: nothing at {path!r} under the weights directory", what)
        return real


# ------------------------------------------------------------------------------------- generation
async def _prompts(state: ServerState, req: oa.CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
        if state.tokenizer is None:
            raise oa.BadRequest("prompt: this server takes token ids (no tokenizer loaded)", "prompt")
        texts = [p] if isinstance(p, str) else p
        return await off_loop(sum(map(len, texts)), encode_texts, state, texts, req.add_special_tokens)
    return [p] if isinstance(p[0], int) else [list(x) for x in p]


def _check_routes_request(state: ServerState, req: oa.CompletionRequest) -> None:
    if not req.return_routed_experts:
        return
    if state.emulate is not None:
        raise oa.BadRequest("return_routed_experts: not a field of the emulated server's API (an emulated "
                            "vLLM returns routes with every choice when started with "
                            "--enable-return-routed-experts)", "return_routed_experts")
    if state.route_layout is None:
        raise oa.BadRequest("return_routed_experts: this server does not record MoE routes; start it with "
                            "--enable-return-routed-experts (an MoE model)", "return_routed_experts")
    if req.stream:
        raise oa.BadRequest("return_routed_experts: routes come with non-streaming responses only",
                            "return_routed_experts")


async def handle_generation(state: ServerState, request: Request, chat: bool) -> Any:
    started = time.monotonic()
    req = oa.parse(oa.ChatRequest if chat else oa.CompletionRequest, await read_json(request))
    state.served.check(req.model)
    oa.refuse_unhonoured(req)
    if not chat:
        _check_routes_request(state, req)
    if chat:  # the template and its tokenizing, off the event loop when the body is large
        size = len(await request.body())
        prompts = [await off_loop(size, chat_prompt, state.tokenizer, req)]
    else:
        prompts = await _prompts(state, req)
    top = (req.top_logprobs or 0) if chat else (req.logprobs or 0)
    work = plan(state, req, prompts, top)
    rid = out.new_id("chatcmpl" if chat else "cmpl", request.headers.get("X-Request-Id") or req.request_id)
    need = len(work)
    state.admit(need)
    try:
        await state.wait_resumed()
        if req.stream:
            from saorl.engines.serve.streaming import stream_events

            events = stream_events(state, req, prompts, work, chat, rid, started)
            return StreamingResponse(_released(events, state, need), media_type="text/event-stream")
        results = await unless_gone(request, generate_all(state, work), need)  # cancelled if the client left
        results = await state.extras.get("postprocess", _same)(state, prompts, req, results)
    except BaseException:
        state.release(need)
        raise
    state.release(need)
    plen = sum(len(p) for p in prompts)
    state.metrics.record(plen, results, time.monotonic() - started)
    use = out.usage(plen, sum(len(r.token_ids) for r in results))
    if chat:
        role = response_role(req)
        choices = [out.chat_choice(state, req, i, r, role) for i, r in enumerate(results)]
        body = out.response(state, True, rid, choices, use, prompts[0] if req.return_token_ids else None)
    else:
        choices = [out.completion_choice(state, req, i, r, prompts[i // req.n])
                   for i, r in enumerate(results)]
        body = out.response(state, False, rid, choices, use)
    return await json_response(out.with_extension(state, body, results),
                               8 * (plen + sum(len(r.token_ids) for r in results)))


async def _same(state, prompts, req, results):
    return results


async def _released(events: AsyncIterator[str], state: ServerState, need: int) -> AsyncIterator[str]:
    try:
        async for e in events:
            yield e
    finally:
        state.release(need)


# ------------------------------------------------------------------------------------- the app
def create_app(engine: InferenceEngine, *, tokenizer=None, model_name: str = "saorl",
               served: ServedModel | None = None, limits: ServerLimits | None = None,
               weights_dir: str | Path | None = None, emulate: Emulate = None,
               **emulation_options: Any) -> FastAPI:
    """The ASGI app serving ``engine`` (see the module docstring). ``served`` says what is served;
    without it, ``model_name`` with the engine's context length and the tokenizer's EOS."""
    limits = limits or ServerLimits()
    served = served or ServedModel((model_name,), model_name, getattr(engine, "max_seq_len", None),
                                   eos_token_id=getattr(tokenizer, "eos_token_id", None))
    wdir = Path(os.path.realpath(weights_dir)) if weights_dir is not None else None
    state = ServerState(engine, tokenizer, served, limits, wdir, emulate)
    app = FastAPI(title="saorl serve", docs_url=None, redoc_url=None, openapi_url=None)  # see .openapi()
    app.state.saorl = state
    _add_handlers(app, state)

    @app.post("/v1/completions", openapi_extra=oa.request_body(oa.CompletionRequest))
    async def completions(request: Request):
        return await handle_generation(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=oa.request_body(oa.ChatRequest))
    async def chat_completions(request: Request):
        return await handle_generation(state, request, chat=True)

    @app.post("/update_weights", openapi_extra=oa.request_body(oa.WeightUpdate))
    async def update_weights(request: Request):
        req = oa.parse(oa.WeightUpdate, await read_json(request))
        path = state.allowed_path(req.path)
        try:  # checked before anything is applied: a file that fails leaves the old weights
            await asyncio.to_thread(engine.update_weights, str(path), req.version)
        except (ValueError, OSError) as e:
            raise oa.BadRequest(f"path: cannot load weights: {e}", "path") from None
        return {"status": "ok", "version": engine.version}

    add_info_routes(app, state)
    if state.emulation is not None:
        from saorl.engines.serve.emulation import add_emulated_routes

        add_emulated_routes(app, state, **emulation_options)
    app.add_middleware(BodyLimit, limits=limits)
    return app


def _add_handlers(app: FastAPI, state: ServerState) -> None:
    limits = state.limits

    @app.exception_handler(oa.BadRequest)
    async def _bad(_r, e: oa.BadRequest):
        return error_response(400, str(e), e.param)

    @app.exception_handler(oa.ModelNotFound)
    async def _no_model(_r, e: oa.ModelNotFound):
        return error_response(404, str(e), "model")

    @app.exception_handler(Overloaded)
    async def _busy(_r, e: Overloaded):
        state.metrics.refused_busy += 1
        return error_response(503, f"server busy: {e}; retry after {limits.retry_after_s}s",
                              headers={"Retry-After": str(limits.retry_after_s)})

    @app.exception_handler(ClientGone)  # nginx's 499, with no body: nobody reads it, the connection is closed
    async def _gone(_r, e: ClientGone):
        state.metrics.abandoned(e.choices)
        return Response(status_code=499)

    @app.exception_handler(EngineError)
    async def _engine(_r, e: EngineError):
        return error_response(503, str(e))

    @app.exception_handler(PermissionError)
    async def _forbidden(_r, e: PermissionError):
        return error_response(403, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)  # FastAPI's own: the query of an emulated route
    async def _query(_r, e: RequestValidationError):
        err = e.errors()[0]
        name = str(err["loc"][-1]) if err["loc"] else "request"
        return error_response(400, f"{name}: {err['msg']}", name)

    @app.exception_handler(Exception)  # a bug: still an error body (the log has the traceback)
    async def _internal(_r, e: Exception):
        return error_response(500, f"internal server error ({type(e).__name__})")


# ------------------------------------------------------------------------------------- serving
def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket (``port=0`` picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def make_server(app: FastAPI, sock: socket.socket, *, verbose: bool = False):
    import uvicorn

    limits = app.state.saorl.limits
    protocol = functools.partial(HeaderDeadline, timeout_s=limits.header_timeout_s)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            backlog=limits.backlog, timeout_keep_alive=30, timeout_graceful_shutdown=5,
                            lifespan="off", http=protocol)
    return uvicorn.Server(config)


class ServerThread:
    """A server on a daemon thread (tests, in-process use); ``url`` is its base URL."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> None:
        self.sock = bind(host, port, app.state.saorl.limits.backlog)
        self.server = make_server(app, self.sock, verbose=verbose)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="saorl-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        h, p = self.sock.getsockname()[:2]
        self.url = f"http://{h}:{p}"

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve_in_thread(engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0,
                    **kw: Any) -> tuple[ServerThread, str]:
    """Start a server for ``engine`` on a daemon thread; returns ``(server, base_url)``."""
    verbose = kw.pop("verbose", False)
    srv = ServerThread(create_app(engine, **kw), host, port, verbose)
    return srv, srv.url
