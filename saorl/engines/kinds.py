"""The kinds of engine ``rollout.engine`` names, one row each: how a rollout worker builds its
client of the servers from the kind's config section (:mod:`saorl.config.engines`), how the
trainer's publisher administers a server (pause, load, label, resume), and the name the server
goes by in messages.

``local`` is not a row: it is saorl's own engine, built in the worker from the policy
(:func:`saorl.runtime.backends.worker.build_engine`). A kind with an ``admin`` is a server the user started
that the trainer updates in place and checks after its publications
(:class:`saorl.runtime.weights.servers.ServerPublisher`); one without (``http``, ``saorl serve``) loads
the published files itself when a worker tells it the path. Adding a kind is one row here plus its
client (and admin) module, and its config section with its own knobs
(:data:`saorl.config.engines.ENGINE_CONFIGS`; the config does not import the engines). Each row
imports its module only when it is used, so the kinds a run does not use cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from saorl.engines.base import InferenceEngine
from saorl.engines.clients.remote import ServerAdmin
from saorl.engines.clients.routes import RouteLayout
from saorl.engines.clients.transport import HttpTransport

if TYPE_CHECKING:
    from saorl.config.engines import ServerEngineConfig


@dataclass(frozen=True)
class ClientOptions:
    """What every client of servers is built with besides its kind's config: routing replay."""

    return_routes: bool = False
    route_layout: RouteLayout | None = None


@dataclass(frozen=True)
class EngineKind:
    name: str
    server_name: str
    client: Callable[[ServerEngineConfig, ClientOptions], InferenceEngine]
    """``client(config, options)``: a client of the servers at ``config.urls``."""
    admin: Callable[[str, HttpTransport, ServerEngineConfig], ServerAdmin] | None = None
    """``admin(url, transport, config)``: one server's side of a publication; None for a server
    that loads the published files itself."""


def _http(c: ServerEngineConfig, o: ClientOptions) -> InferenceEngine:
    from saorl.engines.clients.http_client import HttpEngine

    # model: one of the server's --served-model-name; none: whatever it serves
    return HttpEngine(c.urls, model=c.model, routing=c.routing, return_routes=o.return_routes,
                      route_layout=o.route_layout)


def _vllm(c: ServerEngineConfig, o: ClientOptions) -> InferenceEngine:
    from saorl.engines.clients.vllm_client import VllmEngine

    return VllmEngine(c.urls, model=c.model, routing=c.routing, return_routes=o.return_routes,
                      route_layout=o.route_layout)


def _vllm_admin(url: str, transport: HttpTransport, c: ServerEngineConfig) -> ServerAdmin:
    from saorl.engines.clients.vllm_client import VllmAdmin

    return VllmAdmin(url, transport)


def _sglang(c: ServerEngineConfig, o: ClientOptions) -> InferenceEngine:
    from saorl.engines.clients.sglang_client import SglangEngine

    return SglangEngine(c.urls, routing=c.routing, return_routes=o.return_routes, route_layout=o.route_layout)


def _sglang_admin(url: str, transport: HttpTransport, c: ServerEngineConfig) -> ServerAdmin:
    from saorl.engines.clients.sglang_client import SglangAdmin

    return SglangAdmin(url, transport, c.pause_mode)


KINDS: dict[str, EngineKind] = {
    "http": EngineKind("http", "saorl serve", _http),
    "vllm": EngineKind("vllm", "vLLM", _vllm, _vllm_admin),
    "sglang": EngineKind("sglang", "SGLang", _sglang, _sglang_admin),
}
"""The engines that are clients of servers, by ``rollout.engine``."""


def server_kind(name: str) -> EngineKind:
    """The row of ``name``; a ValueError naming the kinds for anything else (``local`` included)."""
    if name not in KINDS:
        raise ValueError(f"engine {name!r} is not a client of servers; the kinds are {sorted(KINDS)}")
    return KINDS[name]


def updated_in_place(name: str) -> bool:
    """Whether the trainer puts each version on the servers of ``name`` itself (and checks it)."""
    return name in KINDS and KINDS[name].admin is not None
