"""MoE routes through the servers: saorl serve's ``return_routed_experts``, SGLang's
``meta_info.routed_experts`` and vLLM's ``choices[].routed_experts``, each decoded by its client over
real loopback HTTP and compared with the routes a local engine records for the same request; the
wire formats (:mod:`saorl.engines.clients.routes`) against hand-made payloads."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

from saorl.engines import EngineError, LocalEngine, SamplingParams
from saorl.engines.clients.http_client import HttpEngine
from saorl.engines.clients.routes import RouteLayout, decode_routes, encode_flat, encode_npy
from saorl.engines.clients.sglang_client import SglangEngine
from saorl.engines.clients.vllm_client import VllmEngine
from saorl.engines.serve.server import serve_in_thread
from saorl.models.routing import perturb_routing
from saorl.models.tiny import build_tiny

PROMPT = [5, 6, 7, 8, 9]
LAYOUT = RouteLayout(layers=4, experts=8)  # tiny-moe
CLIENTS = {"http": (None, HttpEngine), "vllm": ("vllm", VllmEngine), "sglang": ("sglang", SglangEngine)}


def _perturbed():
    """The tiny MoE routing each token to 3 experts instead of its 2 (an engine-side mismatch); the
    same weights at every call (a reference engine builds its own)."""
    model = build_tiny("tiny-moe", seed=0)
    perturb_routing(model, top_k=3)
    return model


def _server(tok, tmp_path, kind, record=True):
    eng = LocalEngine(_perturbed(), tok, max_batch_size=4, stop_on_eos=False, record_routes=record)
    extra = {"logprobs_mode": "processed_logprobs"} if kind == "vllm" else {}
    srv, url = serve_in_thread(eng, tokenizer=tok, weights_dir=tmp_path, emulate=CLIENTS[kind][0], **extra)
    return eng, srv, url


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_each_client_decodes_the_routes_the_local_engine_records(tok, tmp_path, kind):
    eng, srv, url = _server(tok, tmp_path, kind)
    client = CLIENTS[kind][1](url, return_routes=True, route_layout=LAYOUT)
    plain = CLIENTS[kind][1](url)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)
    try:
        got = client.generate([PROMPT], sp)[0]
        with LocalEngine(_perturbed(), tok, max_batch_size=1, stop_on_eos=False,
                         record_routes=True) as ref:
            want = ref.generate([PROMPT], sp)[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) == 8
        assert got.routes == want.routes
        assert len(got.routes) == len(PROMPT) + 8 - 1 and {len(r) for r in got.routes} == {4 * 3}
        assert plain.generate([PROMPT], sp)[0].routes is None  # asked for only with routing replay
    finally:
        client.close()
        plain.close()
        srv.shutdown()
        eng.close()


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_server_that_does_not_record_routes_is_a_clear_engine_error(tok, tmp_path, kind):
    eng, srv, url = _server(tok, tmp_path, kind, record=False)
    client = CLIENTS[kind][1](url, return_routes=True, retries=0)
    try:
        with pytest.raises(EngineError, match="--enable-return-routed-experts"):
            client.generate([PROMPT], SamplingParams(max_new_tokens=3, seed=0))
    finally:
        client.close()
        srv.shutdown()
        eng.close()


def test_sglang_aborted_and_continued_request_carries_the_whole_contexts_routes(tok, tmp_path):
    eng, srv, url = _server(tok, tmp_path, "sglang")
    client = SglangEngine(url, return_routes=True, route_layout=LAYOUT)
    n = 60
    sp = SamplingParams(temperature=0, max_new_tokens=n)
    try:
        whole = client.generate([PROMPT], sp)[0]

        async def interrupted():
            task = asyncio.ensure_future(client.agenerate(PROMPT, sp))
            while eng.stats()["tokens_generated"] < n + 20:
                await asyncio.sleep(0.002)
            await client.transport.call("POST", "/pause_generation", {"mode": "abort"}, url=url)
            await asyncio.sleep(0.1)
            await client.transport.call("POST", "/continue_generation", url=url)
            return await task

        cont = asyncio.run(interrupted())
        assert cont.metrics["chunks"] == 2 and cont.token_ids == whole.token_ids
        # the continuation fed prompt + the first chunk's tokens again: its routes cover everything
        assert len(cont.routes) == len(PROMPT) + n - 1
        with LocalEngine(_perturbed(), tok, max_batch_size=1, stop_on_eos=False,
                         record_routes=True) as ref:
            want = ref.generate([PROMPT], sp)[0]
        # the re-prefill routes the first chunk's positions as its step-by-step decode did (a
        # deterministic router; round-off could flip a near-tie, which this input does not have)
        assert whole.routes == want.routes and cont.routes == want.routes
    finally:
        client.close()
        srv.shutdown()
        eng.close()


def test_saorl_serve_refuses_routes_it_cannot_give(tok, tmp_path):
    import httpx

    eng, srv, url = _server(tok, tmp_path, "http", record=False)
    try:
        body = {"prompt": PROMPT, "max_tokens": 2, "return_routed_experts": True}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
        assert "--enable-return-routed-experts" in r.json()["error"]["message"]
    finally:
        srv.shutdown()
        eng.close()


@pytest.mark.parametrize(("engine", "cls"), [("http", HttpEngine), ("vllm", VllmEngine),
                                             ("sglang", SglangEngine)])
def test_a_run_asks_its_servers_for_routes_only_when_it_replays_them(tmp_path, engine, cls):
    from saorl.config import load_config
    from saorl.models.codec import run_tokenizer
    from saorl.runtime.backends.worker import build_engine
    from saorl.runtime.parts import worker_spec

    for replay in (False, True):
        cfg = load_config(None, [f"rollout.engine={engine}", "rollout.engine.urls=[http://127.0.0.1:9]",
                                 f"algo.routing_replay={str(replay).lower()}"])
        codec = run_tokenizer(cfg.model)
        spec = worker_spec(cfg, tmp_path, cfg.model.policy, codec)
        client = build_engine(spec, codec)
        try:
            assert isinstance(client, cls) and client.return_routes is replay
            assert client.route_layout == (LAYOUT if replay else None)  # the policy's, from its config
        finally:
            client.close()


# ----------------------------------------------------------------------------- the wire formats
ROUTES = [[0, 1, 2, 3, 4, 5], [7, 6, 5, 4, 3, 2], [1, 1, 2, 2, 3, 3]]  # 3 positions, 2 layers, k=3


def test_flat_and_npy_round_trip_and_are_what_the_servers_send():
    flat = encode_flat(ROUTES)
    assert base64.b64decode(flat) == np.array(ROUTES, dtype="<i4").tobytes()  # SGLang: raw int32
    assert decode_routes(flat, "flat", 3, "s") == ROUTES
    npy = encode_npy(ROUTES, layers=2, experts=8)
    arr = np.load(io.BytesIO(base64.b64decode(npy)))  # vLLM: np.load of the .npy file
    assert arr.shape == (3, 2, 3) and arr.dtype == np.uint8 and arr.reshape(3, -1).tolist() == ROUTES
    assert np.load(io.BytesIO(base64.b64decode(encode_npy(ROUTES, 2, 300)))).dtype == np.uint16
    assert decode_routes(npy, "npy", 3, "s", RouteLayout(2, 8)) == ROUTES


def _npy(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, np.asarray(arr))
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    ("payload", "encoding", "positions", "layout", "expected"),
    [(None, "flat", 3, None, "no routed experts in the response"),
     ("", "npy", 3, None, "no routed experts in the response"),
     ("not base64!", "flat", 3, None, "malformed routed experts"),
     (base64.b64encode(b"\0" * 6).decode(), "flat", 3, None, "not a whole number of int32 ids"),
     (encode_flat(ROUTES), "flat", 4, None, "18 ids do not split into 4 positions"),
     (encode_flat(ROUTES), "flat", 3, RouteLayout(4, 8), "do not split into the policy's 4 MoE layers"),
     (encode_flat(ROUTES), "flat", 3, RouteLayout(2, 6), "expert id 7 is out of range (must be [0, 6))"),
     (encode_flat([[0, -1]] * 3), "flat", 3, None, "expert id -1 is out of range"),
     (encode_npy(ROUTES, 2, 8), "npy", 2, None, "3 positions, the request fed 2"),
     (encode_npy(ROUTES, 2, 8), "npy", 3, RouteLayout(3, 8), "2 MoE layers, the policy has 3"),
     (_npy(np.zeros((3, 6), dtype=np.int32)), "npy", 3, None, "expected an integer [positions, layers, k]"),
     (_npy(np.zeros((3, 2, 3), dtype=np.float32)), "npy", 3, None, "expected an integer"),
     (base64.b64encode(b"garbage").decode(), "npy", 3, None, "malformed routed experts")],
)
def test_bad_route_payloads_are_engine_errors_naming_the_server(payload, encoding, positions, layout,
                                                                 expected):
    with pytest.raises(EngineError) as info:
        decode_routes(payload, encoding, positions, "SRV", layout)
    assert str(info.value).startswith("SRV: ") and expected in str(info.value)
