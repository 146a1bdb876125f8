"""saorl serve's limits against a real server on loopback: slow headers, deep JSON, requests no
wait would admit, weight files that are not weights; each refusal a JSON error naming what was
wrong, and the server still answering afterwards."""

import functools
import json
import socket
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.engines import LocalEngine
from saorl.engines.serve.server import ServerLimits, serve_in_thread
from saorl.engines.serve.server_limits import json_depth
from saorl.models.hf_format import save_hf_weights
from saorl.models.serialize import save_safetensors_atomic
from saorl.models.tiny import build_tiny

_post = functools.partial(httpx.post, timeout=60)  # the 2-core CI machine can be slow: no 5 s default
_get = functools.partial(httpx.get, timeout=60)


@pytest.fixture()
def served(tok, tmp_path):
    """A server with short deadlines, a small admission limit and a weights directory (its own
    model: a test loads other weights into it)."""
    eng = LocalEngine(build_tiny("tiny-moe", seed=0), tok, max_batch_size=8, stop_on_eos=False)
    limits = ServerLimits(max_pending=8, header_timeout_s=1.0, body_timeout_s=1.0)
    (tmp_path / "w").mkdir()
    srv, url = serve_in_thread(eng, tokenizer=tok, limits=limits, weights_dir=tmp_path / "w")
    yield eng, url, tmp_path / "w"
    srv.shutdown()
    eng.close()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _trickle(url: str, data: bytes, every_s: float = 0.1, give_up_s: float = 10.0,
             sock: socket.socket | None = None) -> tuple[bytes, float]:
    """Send ``data`` a byte at a time (on ``sock``, or a new connection) until the server answers
    and closes; (what it sent, seconds taken)."""
    t0 = time.monotonic()
    with sock or socket.create_connection(_address(url), timeout=give_up_s) as s:
        s.settimeout(every_s)
        out, i = b"", 0
        while time.monotonic() - t0 < give_up_s:
            try:
                if i < len(data):
                    s.sendall(data[i:i + 1])
                    i += 1
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
    return out, time.monotonic() - t0


def _error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def test_headers_sent_one_byte_at_a_time_are_cut_off(served):
    _, url, _ = served
    # 200 bytes of headers at 10 bytes/s would take 20 s: the 1 s deadline ends them (the bound of
    # 6 s leaves room for a loaded machine)
    slow = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow += b"X: y\r\n" * 20
    out, took = _trickle(url, slow)
    assert out.startswith(b"HTTP/1.1 408") and took < 6, (out[:200], took)
    assert _error(out)["message"] == "request headers not received within 1s"
    out, took = _trickle(url, b"")  # a connection that never says anything is closed too
    assert out.startswith(b"HTTP/1.1 408") and took < 6, (out[:200], took)
    # a kept-alive connection: its second request's headers get the same deadline
    s = socket.create_connection(_address(url), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while b"}" not in first:
        first += s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    time.sleep(1.5)  # idle between requests: the keep-alive timeout's business (30 s), not this one's
    out, took = _trickle(url, slow, sock=s)
    assert out.startswith(b"HTTP/1.1 408") and took < 6, (out[:200], took)
    assert _get(url + "/health").json()["status"] == "ok"


def test_headers_that_arrive_in_time_are_served_however_slowly_they_come(served):
    _, url, _ = served
    out, _ = _trickle(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", every_s=0.01)
    assert out.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in out, out[:300]


def test_an_unparsable_request_is_a_json_400(served):
    _, url, _ = served
    out, _ = _trickle(url, b"GARBAGE\r\n\r\n", every_s=0.01)
    assert out.startswith(b"HTTP/1.1 400") and "malformed HTTP request" in _error(out)["message"]
    assert _error(out)["type"] == "BadRequestError"
    assert _get(url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/update_weights"])
def test_deeply_nested_json_is_a_400_naming_the_limit(served, route):
    _, url, _ = served
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 33 + b"5" + b"]" * 33 + b"}"):
        r = _post(url + route, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "request body nests JSON deeper than the limit of 32 levels"
    # brackets inside a string are text, not nesting
    r = _post(url + "/v1/completions", json={"prompt": "[" * 1000, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 1
    assert _get(url + "/health").json()["status"] == "ok"


def _naive_depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(_naive_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_naive_depth, v.values()), default=0)
    return 0


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n'),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                         st.text(alphabet='[]{}"\\ab', max_size=3), kids, max_size=3), max_leaves=20)


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(_json)
def test_json_depth_counts_nesting_not_brackets_in_strings(value):
    assert json_depth(json.dumps(value).encode()) == _naive_depth(value)


def test_json_depth_is_linear_on_an_unterminated_string_of_escapes():
    t0 = time.monotonic()
    assert json_depth(b'["' + b'\\"' * 2_000_000) == 1  # a backtracking scan would take hours
    assert time.monotonic() - t0 < 60  # 0.45-2.2 s measured at load 8.5 on 2 cores (CI is shared)


def test_a_request_no_wait_would_admit_is_a_400_one_that_fits_later_a_503(served):
    _, url, _ = served
    too_big = {"prompt": [[5], [6], [7]], "n": 3, "max_tokens": 1}  # 9 generations, 8 admitted at most
    r = _post(url + "/v1/completions", json=too_big)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "Retry-After" not in r.headers
    assert "asks for 9 generations" in err["message"]
    assert "more than the 8 this server ever admits (--max-pending)" in err["message"]
    fits_later = {"prompt": [5], "n": 4, "max_tokens": 1}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json={
            "prompt": [5, 6], "n": 6, "max_tokens": 4000, "stream": True}) as long:
        lines = long.iter_lines()
        first = next(lines)  # 6 of 8 generations running
        assert first.startswith("data: {") and '"finish_reason":null' in first, first
        r = _post(url + "/v1/completions", json=fits_later)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", (r.text, list(lines)[-6:])
        assert "server busy: 6 generations in flight" in r.json()["error"]["message"]
        assert _post(url + "/v1/completions", json=too_big).status_code == 400  # 400 under load too
    deadline = time.monotonic() + 60  # the stream closed: its generations are released
    while (r := _post(url + "/v1/completions", json=fits_later)).status_code == 503:
        assert time.monotonic() < deadline, "the closed stream's generations were never released"
        time.sleep(0.1)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def _not_weights(wdir) -> list[tuple[str, str, str]]:
    """(what, path under ``wdir``, what the refusal must say) of paths that hold no weights for the
    tiny MoE."""
    import os

    (wdir / "random.safetensors").write_bytes(os.urandom(4096))
    (wdir / "notes.txt").write_text("these are not weights\n")
    (wdir / "empty.safetensors").write_bytes(b"")
    (wdir / "no-config").mkdir()
    other = build_tiny("tiny-moe", seed=1)
    names = save_safetensors_atomic({"nope.weight": other.lm_head.weight}, wdir / "names.safetensors")
    thin = {k: v[..., :1].contiguous() for k, v in other.state_dict().items()}
    shapes = save_safetensors_atomic(thin, wdir / "shapes.safetensors")
    bigger = save_hf_weights(other, other.state_dict(), wdir / "bigger")
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "hidden_size": 8192, "vocab_size": 10**6}))
    broken = save_hf_weights(other, other.state_dict(), wdir / "broken")
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    not_safetensors = "not readable as safetensors"
    return [("random bytes", wdir / "random.safetensors", not_safetensors),
            ("a text file", wdir / "notes.txt", not_safetensors),
            ("an empty file", wdir / "empty.safetensors", not_safetensors),
            ("a directory without config.json", wdir / "no-config", "neither a safetensors file nor a model"),
            ("unknown names", names, "unknown parameter names"),
            ("wrong shapes", shapes, "has shape"),
            ("another model's config.json", bigger, "config.json describes another model"),
            ("a broken safetensors file in a model directory", broken, not_safetensors),
            ("a NUL byte", str(wdir / "a\0b"), "cannot hold a NUL byte"),
            ("nothing there", wdir / "missing", "nothing at"),
            ("a name too long", wdir / ("a" * 5000), "nothing at"),
            ("an empty path", "", "non-empty string")]


def test_every_failed_weight_update_is_a_400_and_the_old_weights_stay(served):
    eng, url, wdir = served
    probe = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    before = _post(url + "/v1/completions", json=probe).json()["choices"][0]["token_ids"]
    for what, path, says in _not_weights(wdir):
        r = _post(url + "/update_weights", json={"path": str(path), "version": 7})
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["param"] == "path" and says in err["message"], (what, err)
    for body in ([1], {"path": str(wdir), "version": -1}, {"path": 5, "version": 1}, {"version": 1},
                 {"path": str(wdir), "version": 1, "extra": 1}, {"path": str(wdir), "version": True}):
        r = _post(url + "/update_weights", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", (body, r.text)
    assert eng.version == 0 and _get(url + "/health").json() == {"status": "ok", "version": 0}
    assert _post(url + "/v1/completions", json=probe).json()["choices"][0]["token_ids"] == before
    good = save_safetensors_atomic(build_tiny("tiny-moe", seed=1).state_dict(), wdir / "good.safetensors")
    r = _post(url + "/update_weights", json={"path": str(good), "version": 7})
    assert r.json() == {"status": "ok", "version": 7}  # the endpoint still loads real weights
    assert _post(url + "/v1/completions", json=probe).json()["choices"][0]["versions"] == [7] * 8


def test_an_unexpected_exception_is_a_json_500(tok):
    class Broken:
        version = 0

        async def agenerate(self, prompt_ids, params):
            raise RuntimeError("a bug")

    srv, url = serve_in_thread(Broken(), tokenizer=tok)
    try:
        r = _post(url + "/v1/completions", json={"prompt": [5]})
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "internal server error (RuntimeError)", "type": "InternalServerError", "param": None,
            "code": 500}
        assert _get(url + "/health").json()["status"] == "ok"
    finally:
        srv.shutdown()


def test_a_request_with_both_content_length_and_chunked_encoding_is_a_400(served):
    _, url, _ = served
    body = b'{"prompt": [1, 2], "max_tokens": 2}'
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
           + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    with socket.create_connection(_address(url), timeout=30) as s:
        s.sendall(req)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert "both Content-Length and Transfer-Encoding" in _error(answer)["message"]


def test_an_unknown_model_name_of_a_megabyte_is_not_echoed_whole(served):
    _, url, _ = served
    r = _post(f"{url}/v1/completions", json={"model": "m" * 1_000_000, "prompt": [1], "max_tokens": 1})
    assert r.status_code == 404 and len(r.content) < 2000, len(r.content)
    assert "(1000000 characters)" in r.json()["error"]["message"]
