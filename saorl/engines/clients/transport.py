"""One pooled async HTTP client for the engines that talk to inference servers.

The HTTP engines (:class:`~saorl.engines.clients.http_client.HttpEngine` for ``saorl serve``, and the
vLLM / SGLang clients) send every request through a :class:`HttpTransport`: one
``httpx.AsyncClient`` (a connection pool of ``max_connections`` keep-alive connections) living on
a private event-loop thread. Callers on any event loop await :meth:`HttpTransport.call`; blocking
callers use :meth:`HttpTransport.run`. So hundreds of requests are in flight at once over a few
reused connections, with no thread per request.

Several servers. With more than one base URL, each request goes to the server :meth:`lease`
picks: ``round_robin`` (in turn) or ``least_loaded`` (the fewest requests in flight from this
client; ties in turn). A lease holds its server for the requests that belong together (a
generation and the version queries around it).

Failures become :class:`~saorl.engines.base.EngineError` with the URL and the cause, which the
rollout worker reports and the trainer re-queues:

- connection refused / connect timeout (a server still starting): retried ``retries`` times with
  exponential backoff (``backoff_s · 2^attempt``), then "cannot reach server";
- no response within ``timeout_s``: "no response within";
- the connection dropped mid-request (the server died): "connection lost mid-request";
- a status other than 2xx: "failed with HTTP <code>: <body>"; a body that is not JSON: "not JSON".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Literal, TypeVar

import httpx

from saorl.engines.base import EngineError

Routing = Literal["round_robin", "least_loaded"]
T = TypeVar("T")


class HttpTransport:
    """A pooled async client over one or more base URLs (see the module docstring)."""

    def __init__(self, urls: str | Sequence[str], *, timeout_s: float = 60.0, retries: int = 2,
                 backoff_s: float = 0.2, max_connections: int = 256,
                 routing: Routing = "least_loaded", connect_timeout_s: float | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"need one or more http(s):// base URLs, got {urls!r}")
        if retries < 0 or timeout_s <= 0 or max_connections < 1:
            raise ValueError(f"need retries >= 0, timeout_s > 0 and max_connections >= 1, got "
                             f"{retries}, {timeout_s}, {max_connections}")
        if routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"routing must be 'round_robin' or 'least_loaded', got {routing!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries, self.backoff_s, self.routing = timeout_s, retries, backoff_s, routing
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._turn = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="saorl-http", daemon=True)
        self._thread.start()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # waiting for a pooled connection is not a failure; connecting may have its own bound
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s or timeout_s, pool=None)

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(limits=limits, timeout=timeout)

        self._client = self.run(make())
        self._closed = False

    # ----------------------------------------------------------------- servers
    def in_flight(self) -> dict[str, int]:
        """Requests in flight from this client, per server."""
        with self._lock:
            return dict(self._in_flight)

    def _pick(self) -> str:
        with self._lock:
            start = next(self._turn)
            order = self.urls[start:] + self.urls[:start]
            url = order[0] if self.routing == "round_robin" else min(order, key=self._in_flight.__getitem__)
            self._in_flight[url] += 1
            return url

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[str]:
        """A server for a group of requests, counted as in flight until the block ends."""
        url = self._pick()
        try:
            yield url
        finally:
            with self._lock:
                self._in_flight[url] -= 1

    # ----------------------------------------------------------------- requests
    def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the transport's loop and block until it is done (not from that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def call(self, method: str, path: str, body: Any = None, *, url: str | None = None,
                   params: dict | None = None, text: bool = False) -> Any:
        """One request on the pooled client; ``url`` defaults to a server picked for it. The parsed
        JSON answer, or with ``text`` the body as it is (a route that answers in plain text)."""
        if url is None:
            async with self.lease() as picked:
                return await self.call(method, path, body, url=picked, params=params, text=text)
        request = self._request(method, url, path, body, params, text)
        fut = asyncio.run_coroutine_threadsafe(request, self._loop)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    async def _request(self, method: str, base: str, path: str, body: Any, params: dict | None,
                       text: bool = False) -> Any:
        full = base + path
        for attempt in range(self.retries + 1):
            try:
                resp = await self._client.request(method, full, json=body, params=params)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt < self.retries:
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                    continue
                raise EngineError(f"{method} {full}: cannot reach server ({e!r}) after {attempt + 1} "
                                  "attempt(s)") from e
            except httpx.TimeoutException as e:
                raise EngineError(f"{method} {full}: no response within {self.timeout_s}s") from e
            except httpx.TransportError as e:
                raise EngineError(f"{method} {full}: connection lost mid-request (server died?): "
                                  f"{e!r}") from e
        if not 200 <= resp.status_code < 300:
            raise EngineError(f"{method} {full} failed with HTTP {resp.status_code}: {resp.text[:500]}")
        if text:
            return resp.text
        if not resp.content:
            return None
        try:
            return resp.json()
        except json.JSONDecodeError as e:
            raise EngineError(f"{method} {full}: response is not JSON: {resp.text[:200]!r}") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
