"""Serve any :class:`InferenceEngine` over HTTP with an OpenAI-compatible completions API.

A threaded stdlib server (``http.server.ThreadingHTTPServer``): each request runs in its own
thread and calls ``engine.generate([prompt], params)``, so concurrent HTTP requests meet in the
engine's continuous batch. Endpoints:

``POST /v1/completions`` — body fields, named as in vLLM's ``CompletionRequest``:
``prompt`` (list of token ids, or a one-element list of such lists; a string only when the
server has a tokenizer), ``max_tokens`` (default 16, as OpenAI), ``temperature`` (default 1),
``top_p``, ``top_k`` (vLLM uses -1 for off; -1 and 0 both mean off here), ``stop`` (string or
list), ``stop_token_ids``, ``seed``, ``logprobs`` (only 0/1/None: the sampled token's logprob is
always returned; alternatives are not), ``return_tokens_as_token_ids``, ``n`` (must be 1),
``model`` (ignored). Unknown fields are rejected with 400 so a typo never silently samples with
defaults. Response: ``choices[0]`` holds ``text``, ``token_ids``, ``logprobs`` =
``{"tokens": [...], "token_logprobs": [...]}`` (tokens as ``"token_id:<id>"`` strings when
``return_tokens_as_token_ids``, vLLM's format), ``finish_reason`` and ``stop_reason``; ``usage``
as OpenAI; saorl extras under ``"saorl": {"versions": [...], "engine_version": v}``.

``GET /health`` → ``{"status": "ok", "version": v}``. ``GET /v1/models`` → OpenAI model list.
``POST /update_weights`` with ``{"path": "<file.safetensors>", "version": v}`` — accepted only
from loopback clients (the file is read from this machine's disk).

Errors: bad body → 400 ``{"error": {"message", "type": "invalid_request_error"}}``; engine
failure → 503; unknown path → 404.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from saorl.engines.base import EngineError, InferenceEngine, SamplingParams

_FIELDS = {
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "return_tokens_as_token_ids",
    "n",
    "model",
    "stream",
    "echo",
}


class BadRequest(ValueError):
    """The request body is malformed; the message names the field."""


def _prompt_ids(body: dict[str, Any], tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("prompt: this server takes token ids (a list of ints), not text")
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise BadRequest("prompt: expected a list of token ids (ints) or a one-element list of them")
    return prompt


def params_from_body(body: dict[str, Any]) -> SamplingParams:
    """vLLM-style completion fields → :class:`SamplingParams` (raises BadRequest naming the field)."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequest(f"unsupported fields: {unknown}")
    if body.get("n", 1) != 1:
        raise BadRequest("n: only n=1 is supported (one rollout per request)")
    if body.get("stream") or body.get("echo"):
        raise BadRequest("stream / echo are not supported")
    if body.get("logprobs") not in (None, 0, 1):
        raise BadRequest("logprobs: only the sampled token's logprob is returned (use 1)")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    top_k = body.get("top_k", 0)
    seed = body.get("seed")
    try:
        return SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=0 if top_k in (-1, None) else int(top_k),
            max_new_tokens=int(body.get("max_tokens", 16)),
            stop=stop,
            stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()),
            seed=None if seed is None else int(seed),
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from e


def completion_response(result, prompt_len: int, model: str, as_ids: bool, tokenizer, version: int) -> dict:
    ids = result.token_ids
    text = tokenizer.decode(ids) if tokenizer is not None else ""
    tokens = (
        [f"token_id:{t}" for t in ids]
        if as_ids or tokenizer is None
        else [tokenizer.decode([t]) for t in ids]
    )
    choice = dict(
        index=0,
        text=text,
        token_ids=ids,
        logprobs=dict(tokens=tokens, token_logprobs=result.logprobs),
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
    )
    return dict(
        id=f"cmpl-{uuid.uuid4().hex}",
        object="text_completion",
        created=int(time.time()),
        model=model,
        choices=[choice],
        usage=dict(prompt_tokens=prompt_len, completion_tokens=len(ids), total_tokens=prompt_len + len(ids)),
        saorl=dict(versions=result.versions, engine_version=version),
    )


class _Handler(BaseHTTPRequestHandler):
    server: _EngineServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str) -> None:
        self._send(code, {"error": {"message": message, "type": kind, "code": code}})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except json.JSONDecodeError as e:
            raise BadRequest(f"body is not valid JSON: {e}") from e

    def do_GET(self) -> None:
        eng = self.server.engine
        if self.path == "/health":
            self._send(200, {"status": "ok", "version": eng.version})
        elif self.path == "/v1/models":
            self._send(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.server.model_name,
                            "object": "model",
                            "owned_by": "saorl",
                            "version": eng.version,
                        }
                    ],
                },
            )
        else:
            self._error(404, f"no route GET {self.path}", "not_found")

    def do_POST(self) -> None:
        try:
            if self.path == "/v1/completions":
                self._completions(self._body())
            elif self.path == "/update_weights":
                self._update(self._body())
            else:
                self._error(404, f"no route POST {self.path}", "not_found")
        except BadRequest as e:
            self._error(400, str(e), "invalid_request_error")
        except ValueError as e:  # the engine's own validation (token range, prompt length, ...)
            self._error(400, str(e), "invalid_request_error")
        except EngineError as e:
            self._error(503, str(e), "engine_error")

    def _completions(self, body: Any) -> None:
        params = params_from_body(body)
        prompt = _prompt_ids(body, self.server.tokenizer)
        eng = self.server.engine
        result = eng.generate([prompt], params)[0]
        self._send(
            200,
            completion_response(
                result,
                len(prompt),
                self.server.model_name,
                bool(body.get("return_tokens_as_token_ids")),
                self.server.tokenizer,
                eng.version,
            ),
        )

    def _update(self, body: Any) -> None:
        if not ipaddress.ip_address(self.client_address[0]).is_loopback:
            self._error(403, "update_weights is accepted from loopback clients only", "forbidden")
            return
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("path"), str)
            or not isinstance(body.get("version"), int)
        ):
            raise BadRequest('update_weights expects {"path": str, "version": int}')
        try:
            self.server.engine.update_weights(body["path"], body["version"])
        except FileNotFoundError as e:
            raise BadRequest(f"path: {e}") from e
        self._send(200, {"status": "ok", "version": self.server.engine.version})


class _EngineServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, engine: InferenceEngine, tokenizer, model_name: str, verbose: bool) -> None:
        super().__init__(addr, _Handler)
        self.engine, self.tokenizer, self.model_name, self.verbose = engine, tokenizer, model_name, verbose


def make_server(
    engine: InferenceEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    tokenizer=None,
    model_name: str = "saorl",
    verbose: bool = False,
) -> ThreadingHTTPServer:
    """A bound (not yet serving) server; ``port=0`` picks a free port (read ``server.server_address``)."""
    return _EngineServer((host, port), engine, tokenizer, model_name, verbose)


def serve_in_thread(
    engine: InferenceEngine, host: str = "127.0.0.1", port: int = 0, **kw: Any
) -> tuple[ThreadingHTTPServer, str]:
    """Start a server on a daemon thread; returns ``(server, base_url)``. Stop with ``server.shutdown()``."""
    server = make_server(engine, host, port, **kw)
    threading.Thread(target=server.serve_forever, name="saorl-http", daemon=True).start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}"
