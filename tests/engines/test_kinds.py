"""The table of engine kinds: each row builds its own client and admin, and nothing else does."""

import pytest

from saorl.config.engines import ENGINE_CONFIGS
from saorl.engines.clients.http_client import HttpEngine
from saorl.engines.clients.routes import RouteLayout
from saorl.engines.clients.sglang_client import SglangAdmin, SglangEngine
from saorl.engines.clients.transport import HttpTransport
from saorl.engines.clients.vllm_client import VllmAdmin, VllmEngine
from saorl.engines.kinds import KINDS, ClientOptions, server_kind, updated_in_place


@pytest.mark.parametrize(("name", "client", "admin", "server"), [
    ("http", HttpEngine, None, "saorl serve"),
    ("vllm", VllmEngine, VllmAdmin, "vLLM"),
    ("sglang", SglangEngine, SglangAdmin, "SGLang"),
])
def test_each_row_builds_its_client_and_admin(name, client, admin, server):
    kind = server_kind(name)
    layout = RouteLayout(4, 8)
    options = ClientOptions(return_routes=True, route_layout=layout)
    knobs = {"model": "policy"} if name != "sglang" else {"pause_mode": "retract"}
    config = ENGINE_CONFIGS[name](urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], routing="round_robin",
                                  **knobs)
    engine = kind.client(config, options)
    try:
        assert type(engine) is client and kind.server_name == server
        assert engine.transport.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert engine.transport.routing == "round_robin"
        assert engine.return_routes and engine.route_layout == layout
        # rollout.engine.model is the served name of vLLM and of saorl serve (--served-model-name)
        assert engine.model == {"vllm": "policy", "http": "policy"}.get(name, engine.model)
    finally:
        engine.close()
    assert updated_in_place(name) == (admin is not None)
    if admin is not None:
        transport = HttpTransport("http://127.0.0.1:1")
        try:
            a = kind.admin("http://127.0.0.1:1/", transport, config)
            assert type(a) is admin and a.url == "http://127.0.0.1:1"
            assert name != "sglang" or a.mode == "retract"
        finally:
            transport.close()


def test_local_and_unknown_kinds_are_not_rows():
    assert not updated_in_place("local") and "local" not in KINDS
    for name in ("local", "tgi"):
        with pytest.raises(ValueError, match=rf"'{name}' is not a client of servers; the kinds are"):
            server_kind(name)
        assert not updated_in_place(name)


def test_every_kind_of_the_config_but_local_is_a_row():
    """A kind the config accepts is built by a row here (a fifth kind: its section, its row, its client)."""
    assert set(ENGINE_CONFIGS) == {"local", *KINDS}
    for name, row in KINDS.items():
        assert row.name == name
