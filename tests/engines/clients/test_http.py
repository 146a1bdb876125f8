import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from saorl.engines import EngineError, HttpEngine, LocalEngine, SamplingParams
from saorl.engines.serve.server import serve_in_thread
from saorl.models.serialize import save_safetensors_atomic
from saorl.models.tiny import build_tiny
from tests.engines.conftest import PROMPTS

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def served(tiny_moe, tok):
    eng = LocalEngine(tiny_moe, tok, max_batch_size=4)
    server, url = serve_in_thread(eng, tokenizer=tok)
    yield eng, url
    server.shutdown()
    eng.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # mostly first-use kernel set-up of the model's grouped_mm on CPU
def test_round_trip_equals_local_engine(served, tok):
    eng, url = served
    prompts = [tok.encode(s) for s in PROMPTS]
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    local = eng.generate(prompts, sp)
    client = HttpEngine(url, timeout_s=30)
    remote = client.generate(prompts, sp)
    for a, b in zip(local, remote):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-6)
        assert (b.finish_reason, b.versions) == (a.finish_reason, a.versions)
    seeded = SamplingParams(temperature=0.8, top_k=30, max_new_tokens=8, seed=5, stop=("ee",))
    assert client.generate(prompts[:1], seeded)[0].token_ids == eng.generate(prompts[:1], seeded)[0].token_ids
    client.close()


def test_engine_errors_are_http_400(served):
    _, url = served
    client = HttpEngine(url)
    with pytest.raises(EngineError, match=r"HTTP 400.*stop_token_ids"):
        client.generate([[5]], SamplingParams(stop_token_ids=(10**6,)))
    with pytest.raises(EngineError, match=r"HTTP 400.*prompt"):
        client.generate([[5, 10**6]], SamplingParams())
    client.close()


def test_update_weights_only_from_the_weights_dir(tok, tmp_path):
    eng = LocalEngine(build_tiny("tiny-moe", seed=0), tok, max_batch_size=2)
    server, url = serve_in_thread(eng, weights_dir=tmp_path / "w")
    (tmp_path / "w").mkdir()
    try:
        client = HttpEngine(url)
        sp = SamplingParams(temperature=0, max_new_tokens=10)
        before = client.generate([[5, 6, 7]], sp)[0]
        path = save_safetensors_atomic(build_tiny("tiny-moe", seed=1).state_dict(), tmp_path / "w" / "v3.st")
        client.update_weights(str(path), version=3)
        after = client.generate([[5, 6, 7]], sp)[0]
        assert client.version == 3 == eng.version and after.versions == [3] * len(after.token_ids)
        assert after.token_ids != before.token_ids
        outside = save_safetensors_atomic(build_tiny("tiny-moe", seed=2).state_dict(), tmp_path / "x.st")
        with pytest.raises(EngineError, match=r"HTTP 403.*under the server's weights directory"):
            client.update_weights(str(outside), 4)
        with pytest.raises(EngineError, match=r"HTTP 403.*under the server's weights directory"):
            client.update_weights("/nonexistent/w.safetensors", 4)  # same answer: existence not revealed
        with pytest.raises(EngineError, match=r"HTTP 400.*nothing at"):
            client.update_weights(str(tmp_path / "w" / "missing.st"), 4)
        with pytest.raises(EngineError, match="state dict cannot be sent"):
            client.update_weights(build_tiny("tiny-moe", seed=1).state_dict(), 5)
        assert eng.version == 3
        client.close()
    finally:
        server.shutdown()
        eng.close()


def test_connection_refused_is_retried_then_fails_clearly():
    port = _free_port()
    client = HttpEngine(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.05, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"cannot reach server .* after 3 attempt\(s\)"):
        client.generate([[1, 2]], SamplingParams())
    assert 0.15 <= time.monotonic() - t0 < 5
    client.close()


def test_silent_server_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        client = HttpEngine(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"no response within 0\.5s"):
            client.generate([[1, 2]], SamplingParams())
        assert time.monotonic() - t0 < 3
        client.close()


class _Stub(ThreadingHTTPServer):
    """Answers each completion after all ``hold`` requests have arrived (or 10 s), counting the
    most requests it ever had open at once."""

    daemon_threads = True
    request_queue_size = 512

    def __init__(self, hold: int) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.hold, self.open, self.peak = hold, 0, 0
        self.cond = threading.Condition()


class _StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        srv: _Stub = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.cond:
            srv.open += 1
            srv.peak = max(srv.peak, srv.open)
            srv.cond.notify_all()
            srv.cond.wait_for(lambda: srv.peak >= srv.hold, timeout=10)
            srv.open -= 1
        ids = body["prompt"][:1]
        data = json.dumps({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5]},
                                        "finish_reason": "length"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_pooled_client_keeps_64_requests_in_flight():
    stub = _Stub(hold=64)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    client = HttpEngine(f"http://127.0.0.1:{stub.server_address[1]}", timeout_s=30)
    try:
        async def many():
            return await asyncio.gather(*(client.agenerate([i + 1], SamplingParams()) for i in range(80)))

        t0 = time.monotonic()
        results = asyncio.run(many())
        assert stub.peak >= 64, f"only {stub.peak} requests were in flight at once"
        assert time.monotonic() - t0 < 10  # released by the 64th arrival, not by the 10 s timeout
        assert [r.token_ids for r in results] == [[i + 1] for i in range(80)]
    finally:
        client.close()
        stub.shutdown()
        stub.server_close()


def test_least_loaded_routing_spreads_requests():
    stubs = [_Stub(hold=8) for _ in range(2)]
    for s in stubs:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    client = HttpEngine([f"http://127.0.0.1:{s.server_address[1]}" for s in stubs], timeout_s=30)
    try:
        client.generate([[i + 1] for i in range(16)], SamplingParams())
        assert [s.peak for s in stubs] == [8, 8]  # each got half, all at once
    finally:
        client.close()
        for s in stubs:
            s.shutdown()
            s.server_close()


@pytest.mark.slow
def test_server_killed_mid_request_raises_engine_error():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "saorl.cli", "serve", "--model", "tiny-moe", "--port", "0",
         "--max-batch-size", "2", "--no-stop-on-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        url = line.split("listening on ")[1].strip()
        client = HttpEngine(url, timeout_s=30, retries=0)
        assert client.generate([[5]], SamplingParams(temperature=0, max_new_tokens=2))[0].token_ids
        errors, t0 = [], time.monotonic()

        def long_request():
            try:
                client.generate([[5, 6]], SamplingParams(max_new_tokens=4000))
            except EngineError as e:
                errors.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        t.join(timeout=20)
        assert not t.is_alive(), "client hung after the server died"
        assert len(errors) == 1 and "connection lost mid-request" in str(errors[0])
        assert time.monotonic() - t0 < 20
        client.close()
    finally:
        proc.kill()
        proc.wait()
