"""The limits ``saorl serve`` holds before a request reaches a route, and its error bodies.

Every limit is a :class:`ServerLimits` field and a ``saorl serve`` option; every refusal is an
OpenAI-style JSON error ``{"error": {"message", "type", "param", "code"}}`` whose message names the
limit, and whose ``type`` is vLLM 0.32's name for the status (``BadRequestError``, ``NotFoundError``,
``ServiceUnavailableError``, ``InternalServerError``; the HTTP phrase for the others, ``Request
Timeout``, ``Request Entity Too Large``, ...). Two layers enforce them:

- :class:`HeaderDeadline`, the HTTP protocol (uvicorn's h11 one, with a deadline): the request
  line and headers must arrive within ``header_timeout_s`` of the connection being accepted, or of
  their first byte on a kept-alive connection (whose idle time is uvicorn's keep-alive timeout),
  else 408 and the connection is closed. Without it a client that sends its headers one byte at a
  time holds a connection forever: uvicorn times out neither the headers nor a silent new
  connection. A request h11 cannot parse gets a JSON 400 here too, not uvicorn's plain-text one.
- :class:`BodyLimit`, ASGI middleware: the whole body within ``max_body_bytes`` (413, by
  ``Content-Length`` before a byte is read or as soon as it passes the limit) and
  ``body_timeout_s`` (408: a slow client, a lying ``Content-Length``), and JSON nested at most
  ``max_json_depth`` deep (400; counted on the raw bytes, before any parser sees them: Python's
  recursive parsers fail on deep nesting with a ``RecursionError``).

What the routes check themselves: ``max_pending`` (:meth:`~saorl.engines.serve.server.ServerState.admit`:
503 + ``Retry-After`` while others run, 400 for a request larger than the server ever admits) and
the fields of each request (400 naming the field).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from http import HTTPStatus

import h11
import numpy as np
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ServerLimits:
    max_pending: int = 512
    """Generations admitted at once (running or waiting for a slot); past it, 503 + Retry-After; a
    request that alone asks for more (prompts × ``n``) is a 400."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body accepted (413 past it)."""
    body_timeout_s: float = 10.0
    """A request body must arrive completely within this many seconds (408 otherwise)."""
    header_timeout_s: float = 10.0
    """A request's line and headers must arrive within this many seconds (408 and the connection
    closed otherwise)."""
    max_json_depth: int = 32
    """Deepest nesting of arrays and objects in a JSON body (400 past it; saorl's requests nest 3 deep)."""
    backlog: int = 2048
    """Listen backlog: connections the kernel queues before the server accepts them."""
    retry_after_s: int = 1
    """The ``Retry-After`` a 503 asks clients to wait, in seconds."""

    def __post_init__(self) -> None:
        counts = (self.max_pending, self.max_body_bytes, self.max_json_depth, self.backlog)
        if min(counts) < 1 or not (self.body_timeout_s > 0 and self.header_timeout_s > 0):
            raise ValueError(f"server limits must be positive, got {self}")


class Overloaded(Exception):
    """More generations than ``max_pending`` in flight: answered 503 with ``Retry-After``."""


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               501: "NotImplementedError", 503: "ServiceUnavailableError"}
"""An error's ``type`` by status, as vLLM 0.32 names them; any other status: its HTTP phrase (as
vLLM's handler of HTTP exceptions writes it)."""


def error_body(code: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(code) or HTTPStatus(code).phrase
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(code: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message, param), status_code=code, headers=headers)


# ------------------------------------------------------------------------------------- JSON depth
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
"""A JSON string, or an unterminated one up to the end: always matched at its first quote, so the
scan is linear (an optional closing quote leaves nothing to backtrack into). Unrolled (runs of
plain bytes, then an escape), which scans 4 MB of text in ~30 ms where one alternation per byte
took a second."""
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[{]}")))


def json_depth(raw: bytes) -> int:
    """How deep ``raw`` nests arrays and objects (brackets inside strings are not counted); linear
    in its length, whatever it holds. For text that is not JSON, a number of no meaning."""
    steps = _STRING.sub(b"", raw).translate(_STEP, _NOT_BRACKET)
    if steps.count(1) == 0:
        return 0
    return int(np.cumsum(np.frombuffer(steps, np.int8), dtype=np.int64).max())


# ------------------------------------------------------------------------------------- body limits
class BodyLimit:
    """ASGI middleware: read the whole body within the size, time and nesting limits, then pass it on."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lim = self.limits
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and b"transfer-encoding" in headers:  # RFC 9112 6.3: a smuggling vector
            return await self._refuse(scope, receive, send, 400, "a request may not have both Content-Length "
                                      "and Transfer-Encoding")
        if declared is not None and (not declared.isdigit() or int(declared) > lim.max_body_bytes):
            return await self._refuse(scope, receive, send, 413 if declared.isdigit() else 400,
                                      f"request body over the limit of {lim.max_body_bytes} bytes"
                                      if declared.isdigit() else "Content-Length is not a number")
        chunks, size, deadline = [], 0, time.monotonic() + lim.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                return await self._refuse(scope, receive, send, 408,
                                          f"request body not received within {lim.body_timeout_s:g}s")
            if msg["type"] == "http.disconnect":
                return None
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > lim.max_body_bytes:
                return await self._refuse(scope, receive, send, 413,
                                          f"request body over the limit of {lim.max_body_bytes} bytes")
            if not msg.get("more_body", False):
                break
        body, sent = b"".join(chunks), False
        depth = await asyncio.to_thread(json_depth, body) if len(body) > 2**16 else json_depth(body)
        if depth > lim.max_json_depth:
            return await self._refuse(scope, receive, send, 400, f"request body nests JSON deeper than the "
                                      f"limit of {lim.max_json_depth} levels", close=False)

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, receive, send, code: int, message: str, close: bool = True) -> None:
        """The refusal; ``close`` for a body left unread, which would be taken for the next request."""
        response = error_response(code, message, headers={"Connection": "close"} if close else None)
        await response(scope, receive, send)


# ------------------------------------------------------------------------------------- headers
class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers (module docstring).

    The deadline starts when the connection is accepted and, on a kept-alive connection, at the
    first byte of each next request; it ends when h11 has parsed the headers (the client's state
    leaves ``IDLE``). ``timeout_s`` comes in through ``functools.partial`` (uvicorn builds the
    protocol with its own arguments)."""

    def __init__(self, *args, timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = timeout_s
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._answer(400, "malformed HTTP request")

    def _arm(self) -> None:
        self.header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _too_slow(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._answer(408, f"request headers not received within {self.header_timeout_s:g}s")

    def _answer(self, code: int, message: str) -> None:
        """A JSON error written straight to the socket (no request was parsed), then close."""
        body = json.dumps(error_body(code, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=code, headers=headers), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response already under way: closing is all that is left
            pass
        self.transport.close()
