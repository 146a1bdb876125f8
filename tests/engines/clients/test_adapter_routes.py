"""LoRA adapters on SGLang and vLLM servers, against fakes of their routes on loopback: SGLang's
adapter routes (publication and requests), and a worker two or more versions behind, which names
an adapter the server has unloaded, on both.

The SGLang fake follows SGLang 0.5's documented request and response shapes, checked against
``python/sglang/srt/entrypoints/http_server.py`` (``/load_lora_adapter``, ``/unload_lora_adapter``:
HTTP 200 with ``LoRAUpdateResult`` ``{"success", "error_message", "loaded_adapters"}``, 400 when
``success`` is false; ``/v1/models``: one card per loaded adapter, ``id`` its name, ``root`` its
path, ``parent`` the served model), ``managers/io_struct.py`` (``LoadLoRAAdapterReqInput``
``lora_name`` / ``lora_path``; ``GenerateReqInput.lora_path``, a loaded adapter's name) and
``lora/lora_registry.py`` (the messages for a request naming an adapter that is not loaded, "The
following requested LoRA adapters are not loaded: …", and for unloading a name it does not have,
"LoRA with name … does not exist. Loaded LoRAs: …"), at commit 9c0549b7 of sgl-project/sglang.
The vLLM fake answers as vLLM 0.32 does for a ``model`` it does not serve (HTTP 404, "The model
`…` does not exist."; tests/vllm/test_vllm_lora.py meets that answer on the real server) and lists
its adapters in ``/v1/models`` as vLLM does. SGLang has no CPU build: as for its other paths
(tests/engines/clients/test_remote.py), the test against a real server is marked ``vllm`` and ``gpu`` and
skipped here, and these run against the fake.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from saorl.engines import EngineError, SamplingParams
from saorl.engines.clients.adapters import KEEP_LOADED, adapter_name, adapter_version
from saorl.engines.clients.sglang_client import SglangAdmin, SglangEngine
from saorl.engines.clients.transport import HttpTransport
from saorl.engines.clients.vllm_client import VllmEngine
from saorl.models.adapter import write_adapter_dir
from saorl.models.tiny import build_tiny
from saorl.runtime.weights.files import FilePublisher, FileSource, WeightNames
from saorl.runtime.weights.servers import ServerPublisher

TENSORS = {"base_model.model.x.lora_A.weight": torch.zeros(2, 3),
           "base_model.model.x.lora_B.weight": torch.zeros(3, 2)}


class _Fake(BaseHTTPRequestHandler):
    """The routes of ``server.kind`` ("sglang" or "vllm") that adapters touch."""

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()  # compact, as FastAPI answers
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        srv = self.server
        if self.path == "/v1/models":
            cards = [{"id": "policy", "root": "policy"}]
            cards += [{"id": n, "root": p, "parent": "policy"} for n, p in srv.loaded.items()]
            return self._send(200, {"object": "list", "data": cards})
        self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        srv.requests.append((self.path, body))
        route = (srv.kind, self.path)
        if route == ("sglang", "/load_lora_adapter"):
            srv.loaded[body["lora_name"]] = body["lora_path"]
            return self._send(200, {"success": True, "error_message": None, "loaded_adapters": srv.loaded})
        if route == ("sglang", "/unload_lora_adapter"):
            if body["lora_name"] not in srv.loaded:
                msg = f"LoRA with name {body['lora_name']} does not exist. Loaded LoRAs: {srv.loaded.keys()}"
                out = {"success": False, "error_message": msg, "loaded_adapters": srv.loaded}
                return self._send(400, out)
            del srv.loaded[body["lora_name"]]
            return self._send(200, {"success": True, "error_message": None, "loaded_adapters": srv.loaded})
        if route == ("sglang", "/generate"):
            name = body.get("lora_path")
            if name is not None and name not in srv.loaded:
                msg = (f"The following requested LoRA adapters are not loaded: {name}\n"
                       f"Loaded adapters: {srv.loaded.keys()}.")
                return self._send(400, {"error": {"message": msg}})
            n = body["sampling_params"]["max_new_tokens"]
            meta = {"output_token_logprobs": [[-0.5, 11, None]] * n, "weight_version": "default",
                    "finish_reason": {"type": "length"}}
            return self._send(200, {"output_ids": [11] * n, "meta_info": meta})
        if route == ("vllm", "/v1/completions"):
            name = body.get("model")
            if name != "policy" and name not in srv.loaded:
                msg = f"The model `{name}` does not exist."
                return self._send(404, {"error": {"message": msg, "type": "NotFoundError", "param": "model",
                                                  "code": 404}})
            n = body["max_tokens"]
            choice = {"token_ids": [11] * n, "logprobs": {"token_logprobs": [-0.5] * n},
                      "finish_reason": "length", "stop_reason": None}
            return self._send(200, {"choices": [choice]})
        self._send(404, {"detail": "Not Found"})


@pytest.fixture
def fake():
    servers = []

    def start(kind: str):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
        srv.kind, srv.loaded, srv.requests = kind, {}, []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _publish(tmp_path, url: str, versions) -> ServerPublisher:
    transport = HttpTransport(url, timeout_s=30)
    sync = ServerPublisher(FilePublisher(tmp_path / "weights"), [SglangAdmin(url, transport)], transport,
                            build_tiny("tiny-dense", seed=0))
    for v in versions:
        sync.publish([TENSORS], v, WeightNames.adapter({"r": 2, "lora_alpha": 4}))
    return sync


def _name(tmp_path, v: int) -> str:
    return adapter_name(tmp_path / "weights" / f"v{v:08d}-adapter")


def test_sglang_adapters_are_loaded_by_name_and_all_but_the_newest_two_unloaded(fake, tmp_path):
    srv, url = fake("sglang")
    sync = _publish(tmp_path, url, range(4))
    assert FileSource(sync.files.dir).latest() == (3, str(tmp_path / "weights" / "v00000003-adapter"))
    assert srv.loaded == {_name(tmp_path, v): str((tmp_path / "weights" / f"v{v:08d}-adapter").resolve())
                          for v in (2, 3)} and KEEP_LOADED == 2
    routes = [(p, b["lora_name"]) for p, b in srv.requests]
    load, unload = "/load_lora_adapter", "/unload_lora_adapter"
    assert routes == [(load, _name(tmp_path, 0)), (load, _name(tmp_path, 1)), (load, _name(tmp_path, 2)),
                      (unload, _name(tmp_path, 0)), (load, _name(tmp_path, 3)), (unload, _name(tmp_path, 1))]
    admin = SglangAdmin(url, sync.transport)  # unloading a name it does not have: fine unless asked
    sync.transport.run(admin.unload_adapter("saorl-no-such"))
    with pytest.raises(EngineError, match=r"could not unload saorl-no-such: .*does not exist"):
        sync.transport.run(admin.unload_adapter("saorl-no-such", missing_ok=False))
    sync.close()


def test_an_sglang_refusal_to_load_is_one_error_naming_the_server_and_the_reason(fake, tmp_path):
    from saorl.runtime.weights.servers import WeightPublishError

    srv, url = fake("sglang")
    srv.kind = "refusing"  # every route answers FastAPI's 404: an SGLang without the adapter routes
    with pytest.raises(WeightPublishError, match=f"on the server at {url} failed: .*HTTP 404") as e:
        _publish(tmp_path, url, [0])
    assert "start it with --enable-lora" in str(e.value)


def test_an_sglang_request_names_the_adapter_and_carries_its_version_exactly(fake, tmp_path):
    srv, url = fake("sglang")
    sync = _publish(tmp_path, url, range(3))
    engine = SglangEngine(url)
    try:
        engine.update_weights(str(tmp_path / "weights" / "v00000002-adapter"), 2)
        res = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))[0]
        assert res.versions == [2] * 4  # not the server's label ("default")
        assert srv.requests[-1][1]["lora_path"] == _name(tmp_path, 2)
        assert engine.stats()["adapter_retries"] == 0
    finally:
        engine.close()
        sync.close()


def _behind(engine_cls, kind, fake, tmp_path):
    """A worker that read version 1's announcement, on a server where 2, 3 and 4 were published
    since (the publisher unloaded 1 and 2)."""
    srv, url = fake(kind)
    for v in (3, 4):
        srv.loaded[_name(tmp_path, v)] = str(tmp_path / "weights" / f"v{v:08d}-adapter")
    srv.loaded["saorl-0badc0de-v00000009-adapter"] = "/another/run"  # another run's: never taken
    for v in (1, 4):
        write_adapter_dir(TENSORS, {"r": 2}, tmp_path / "weights" / f"v{v:08d}-adapter")
    engine = engine_cls(url)
    engine.update_weights(str(tmp_path / "weights" / "v00000001-adapter"), 1)
    return srv, engine


@pytest.mark.parametrize(("engine_cls", "kind", "field"), [
    (VllmEngine, "vllm", "model"),
    (SglangEngine, "sglang", "lora_path"),
])
def test_a_worker_behind_retries_once_under_the_newest_adapter_with_its_version(engine_cls, kind, field,
                                                                               fake, tmp_path):
    srv, engine = _behind(engine_cls, kind, fake, tmp_path)
    try:
        res = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))[0]
        assert res.versions == [4] * 3 and res.token_ids == [11] * 3
        named = [b[field] for p, b in srv.requests if p in ("/generate", "/v1/completions")]
        assert named == [_name(tmp_path, 1), _name(tmp_path, 4)]
        assert engine.stats()["adapter_retries"] == 1 and engine.version == 4
        engine.generate([[5]], SamplingParams(max_new_tokens=1))  # it names the newest from now on
        assert srv.requests[-1][1][field] == _name(tmp_path, 4) and engine.stats()["adapter_retries"] == 1
        engine.update_weights(str(tmp_path / "weights" / "v00000004-adapter"), 4)
        del srv.loaded[_name(tmp_path, 4)]  # nothing newer left: the server's own answer, unchanged
        with pytest.raises(EngineError, match=r"HTTP 40[04]") as e:
            engine.generate([[5]], SamplingParams(max_new_tokens=1))
        assert _name(tmp_path, 4) in str(e.value) and engine.stats()["adapter_retries"] == 1
    finally:
        engine.close()


def test_adapter_names_carry_the_version_and_nothing_else_parses():
    name = adapter_name("/runs/a/weights/v00000012-adapter")
    assert adapter_version(name) == 12 and adapter_version("policy") is None
    assert adapter_version(name.replace("-adapter", "")) is None


@pytest.mark.vllm
@pytest.mark.gpu
def test_adapters_against_a_real_sglang_server():
    pytest.skip("needs a running SGLang 0.5 server started with --enable-lora on a GPU machine; this CPU "
                "test suite drives SGLang's adapter routes against the fake above instead")
