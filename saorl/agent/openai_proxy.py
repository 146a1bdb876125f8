"""The loopback endpoint that an OpenAI-API agent's client talks to: one server per event loop.

A minimal HTTP/1.1 server on ``127.0.0.1`` and a port the kernel picks, started when an episode of a
worker opens and none is listening (:func:`open_episode`), and serving every episode of that worker
open at the time: each episode has a token of its own, and its client's base URL is
``http://127.0.0.1:<port>/ep/<token>/v1``. When the loop's last open episode closes, the server
stops listening and is forgotten (the next episode starts another, on another port), so a loop
that plays one episode (``asyncio.run``: an evaluation, ``saorl envs sample``, a test) leaves no
socket and no loop behind; a proxy whose loop was closed with an episode still open is closed by
the next :func:`open_episode`. Routes:

- ``POST /ep/<token>/v1/chat/completions``: one call of the episode (:mod:`saorl.agent.openai_calls`);
- ``GET /ep/<token>/v1/models``: the served model (``env.options.model``).

A token no episode holds is a 404; the token of an episode that ended (its agent returned, raised
or ran past its deadline) is a 410 saying so while the server listens (another episode of the
loop is open), and the connection is refused once it has stopped; either way such a call is not
recorded: a task the agent leaked, still calling after the episode, gets an error, never a place in
a trajectory. Errors are
OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``.

The server runs in the worker's event loop, beside its engine: a call awaits ``engine.agenerate``
there, so the calls of all the worker's episodes meet in the engine's continuous batch. Each
response closes its connection (``Connection: close``); a streamed one is ``text/event-stream``
delimited by the close. Nothing but the loopback interface can reach it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import OrderedDict

from saorl.agent import openai_calls as calls
from saorl.engines.serve.openai_api import BadRequest
from saorl.engines.serve.server_limits import error_body

MAX_BODY_BYTES = 32 * 1024 * 1024
"""A request body past this is a 413 (an agent's whole conversation fits many times)."""
ENDED_KEPT = 4096
"""How many ended episodes' tokens are remembered, to answer their late calls 410 rather than 404."""
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 410: "Gone",
            413: "Payload Too Large", 500: "Internal Server Error"}


class Proxy:
    """The server of one event loop and its open episodes, by token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.episodes: dict[str, calls.Episode] = {}
        self.ended = _ENDED
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.starting: asyncio.Task | None = None
        self.closed = False

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def open(self, episode: calls.Episode) -> str:
        """Register ``episode``; its base URL."""
        token = secrets.token_hex(12)
        self.episodes[token] = episode
        return token

    def url(self, token: str) -> str:
        return f"http://127.0.0.1:{self.port}/ep/{token}/v1"

    def close(self, token: str, why: str) -> None:
        """End the episode of ``token``: later calls get 410 with ``why``."""
        self.episodes.pop(token, None)
        self.ended[token] = why
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        if not self.episodes:
            self.shut()

    def shut(self) -> None:
        """Stop listening and forget this proxy (calls being answered are still answered)."""
        self.closed = True
        if _PROXIES.get(self.loop) is self:
            _PROXIES.pop(self.loop, None)
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await _read_request(reader)
            status, payload = await self._route(method, path, body)
        except _HttpError as e:
            status, payload = e.status, error_body(e.status, str(e))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        try:
            if isinstance(payload, list):  # server-sent events
                head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                writer.write((head + "Connection: close\r\n\r\n").encode() + "".join(payload).encode())
            else:
                data = json.dumps(payload).encode()
                head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                        "Connection: close\r\n\r\n")
                writer.write(head.encode() + data)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, dict | list[str]]:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "ep" or parts[2] != "v1":
            return 404, error_body(404, f"no route {path[:200]!r}: episodes are served under /ep/<token>/v1/")
        token, route = parts[1], "/".join(parts[3:])
        ep = self.episodes.get(token)
        if ep is None:
            if token in self.ended:
                return 410, error_body(410, f"this episode has ended ({self.ended[token]}); a call after the "
                                            "agent's episode is not served and not recorded")
            return 404, error_body(404, "no episode with this token: the client's base URL is not one "
                                        "saorl gave")
        if route == "models" and method == "GET":
            return 200, calls.models(ep)
        if route != "chat/completions":
            return 404, error_body(404, f"no route {route!r}: this endpoint serves chat/completions and "
                                        "models")
        if method != "POST":
            return 405, error_body(405, "chat/completions takes POST")
        return await self._chat(token, ep, body)

    async def _chat(self, token: str, ep: calls.Episode, body: bytes) -> tuple[int, dict | list[str]]:
        try:
            try:
                parsed = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not JSON: {e}") from None
            req = calls.check(ep, parsed)
            prompt, res = await calls.sample(ep, req)
            if self.episodes.get(token) is not ep:  # ended while the engine sampled: not recorded
                why = self.ended.get(token, "ended")
                return 410, error_body(410, f"this episode ended during the call ({why}); the reply is not "
                                            "recorded")
            out = calls.reply(ep, req, prompt, res)  # before recording: a reply that fails is no call
            body = calls.stream_events(ep, req, out) if req.stream else out
        except calls.Refused as e:
            return e.status, error_body(e.status, str(e), e.param)
        except BadRequest as e:
            return 400, error_body(400, str(e), e.param)
        except Exception as e:  # a saorl bug: the episode fails with it, the agent hears a 500
            ep.error = e
            return 500, error_body(500, f"saorl failed on this call: {type(e).__name__}: {e}"[:600])
        calls.record(ep, prompt, res)
        return 200, body


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, path, _ = lines[0].split(" ", 2)
    except ValueError:
        raise _HttpError(400, f"malformed request line {lines[0][:100]!r}") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _HttpError(400, "chunked request bodies are not served; send Content-Length")
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise _HttpError(400, "Content-Length is not a number") from None
    if length > MAX_BODY_BYTES:
        raise _HttpError(413, f"the request body has {length} bytes, over {MAX_BODY_BYTES}")
    body = await reader.readexactly(length) if length else b""
    return method.upper(), path, body


_PROXIES: dict[asyncio.AbstractEventLoop, Proxy] = {}
"""The listening proxy of each loop that has an episode open (a proxy refers to its loop, so a weak
key would never be freed: :meth:`Proxy.shut` removes the entry)."""
_ENDED: OrderedDict[str, str] = OrderedDict()
"""Ended episodes' tokens, of every proxy: a late call that reaches another proxy on a reused port
is still a 410."""


async def open_episode(episode: calls.Episode) -> tuple[Proxy, str]:
    """Register ``episode`` with the running loop's proxy, started if none listens; (proxy, token).
    :meth:`Proxy.close` of the token ends it, and the proxy with the loop's last episode."""
    loop = asyncio.get_running_loop()
    for other, proxy in list(_PROXIES.items()):
        if other.is_closed():  # its loop closed with an episode open (cancelled, never cleaned up)
            proxy.shut()
    while True:
        proxy = _PROXIES.get(loop)
        if proxy is None:
            proxy = _PROXIES[loop] = Proxy(loop)
            proxy.starting = asyncio.ensure_future(proxy.start())
        try:
            await asyncio.shield(proxy.starting)
        except Exception:
            proxy.shut()
            raise
        if not proxy.closed:  # no await from here to open: the proxy cannot shut in between
            return proxy, proxy.open(episode)
