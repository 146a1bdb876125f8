import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from saorl.engines import EngineError, HttpEngine, LocalEngine, SamplingParams
from saorl.engines.server import serve_in_thread
from saorl.models.tiny import build_tiny
from tests.engines.conftest import PROMPTS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tiny_moe, tok):
    eng = LocalEngine(tiny_moe, tok, max_batch_size=4)
    server, url = serve_in_thread(eng, tokenizer=tok)
    yield eng, url
    server.shutdown()
    server.server_close()
    eng.close()


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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
    remote = HttpEngine(url, timeout_s=30).generate(prompts, sp)
    for a, b in zip(local, remote):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-6)
        assert (b.finish_reason, b.versions) == (a.finish_reason, a.versions)
    seeded = SamplingParams(temperature=0.8, top_k=30, max_new_tokens=8, seed=5, stop=("ee",))
    assert (
        HttpEngine(url).generate(prompts[:1], seeded)[0].token_ids
        == eng.generate(prompts[:1], seeded)[0].token_ids
    )


def test_openai_fields_and_errors(served, tok):
    _, url = served
    code, out = _post(
        url + "/v1/completions",
        {
            "prompt": [tok.encode("hi")],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "top_k": -1,
        },
    )
    assert code == 200
    choice = out["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"]) and out["saorl"]["versions"]
    code, out = _post(url + "/v1/completions", {"prompt": [5], "max_tokns": 3})
    assert code == 400 and "max_tokns" in out["error"]["message"]
    code, out = _post(url + "/v1/completions", {"prompt": [5], "temperature": -2})
    assert code == 400 and "temperature" in out["error"]["message"]
    code, out = _post(url + "/v1/completions", {"prompt": [5, 10**6]})
    assert code == 400 and "token ids" in out["error"]["message"]
    with pytest.raises(EngineError, match="HTTP 400"):
        HttpEngine(url).generate([[5]], SamplingParams(stop_token_ids=(10**6,)))
    with urllib.request.urlopen(url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"
    with urllib.request.urlopen(url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "saorl"


def test_update_weights_over_http(tok):
    eng = LocalEngine(build_tiny("tiny-moe", seed=0), tok, max_batch_size=2)
    server, url = serve_in_thread(eng)
    try:
        client = HttpEngine(url)
        sp = SamplingParams(temperature=0, max_new_tokens=10)
        before = client.generate([[5, 6, 7]], sp)[0]
        client.update_weights(build_tiny("tiny-moe", seed=1).state_dict(), version=3)
        after = client.generate([[5, 6, 7]], sp)[0]
        assert client.version == 3 == eng.version and after.versions == [3] * len(after.token_ids)
        assert after.token_ids != before.token_ids
        with pytest.raises(EngineError, match="HTTP 400"):
            client.update_weights("/nonexistent/w.safetensors", 4)
    finally:
        server.shutdown()
        server.server_close()
        eng.close()


def test_connection_refused_is_retried_then_fails_clearly():
    port = _free_port()
    client = HttpEngine(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.05, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"cannot reach server .* after 3 attempt\(s\)"):
        client.generate([[1, 2]], SamplingParams())
    assert 0.15 <= time.monotonic() - t0 < 5


def test_silent_server_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        client = HttpEngine(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"no response within 0\.5s"):
            client.generate([[1, 2]], SamplingParams())
        assert time.monotonic() - t0 < 3


def test_sglang_dialect_maps_fields():
    seen = {}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            seen["path"] = self.path
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(
                {
                    "text": "ab",
                    "output_ids": [7, 8],
                    "meta_info": {
                        "finish_reason": {"type": "stop", "matched": "b"},
                        "output_token_logprobs": [[-0.5, 7, "a"], [-1.5, 8, "b"]],
                    },
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = HttpEngine(f"http://127.0.0.1:{server.server_address[1]}", dialect="sglang")
        r = client.generate([[1, 2]], SamplingParams(temperature=0.5, top_k=4, stop=("b",), seed=9))[0]
    finally:
        server.shutdown()
        server.server_close()
    assert seen["path"] == "/generate" and seen["body"]["input_ids"] == [1, 2]
    assert (
        seen["body"]["sampling_params"]["top_k"] == 4
        and seen["body"]["sampling_params"]["sampling_seed"] == 9
    )
    assert (r.token_ids, r.logprobs, r.finish_reason, r.stop_reason) == ([7, 8], [-0.5, -1.5], "stop", "b")


@pytest.mark.slow
def test_server_killed_mid_request_raises_engine_error():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "saorl.cli",
            "serve",
            "--model",
            "tiny-moe",
            "--port",
            "0",
            "--max-batch-size",
            "2",
            "--no-stop-on-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env=env,
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
    finally:
        proc.kill()
        proc.wait()
