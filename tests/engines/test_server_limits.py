"""saorl serve's limits against a real server on loopback: slow headers, deep JSON, requests no
wait would admit; each refusal a JSON error naming what was wrong, and the server still answering
afterwards."""

import functools
import json
import socket
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.engines import LocalEngine
from saorl.engines.server import ServerLimits, serve_in_thread
from saorl.engines.server_limits import json_depth
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
    assert _error(out)["type"] == "invalid_request_error"
    assert _get(url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/update_weights"])
def test_deeply_nested_json_is_a_400_naming_the_limit(served, route):
    _, url, _ = served
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 33 + b"5" + b"]" * 33 + b"}"):
        r = _post(url + route, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "request body nests JSON deeper than the limit of 32 levels"
    # brackets inside a string are text, not nesting
    r = _post(url + "/v1/completions", json={"prompt": "[" * 1000, "max_tokens": 1})
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
    assert time.monotonic() - t0 < 2


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
        assert first.startswith("data: {") and '"finish_reason": null' in first, first
        r = _post(url + "/v1/completions", json=fits_later)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", (r.text, list(lines)[-6:])
        assert "server busy: 6 generations in flight" in r.json()["error"]["message"]
        assert _post(url + "/v1/completions", json=too_big).status_code == 400  # 400 under load too
    deadline = time.monotonic() + 60  # the stream closed: its generations are released
    while (r := _post(url + "/v1/completions", json=fits_later)).status_code == 503:
        assert time.monotonic() < deadline, "the closed stream's generations were never released"
        time.sleep(0.1)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_an_unexpected_exception_is_a_json_500(tok):
    class Broken:
        version = 0

        async def agenerate(self, prompt_ids, params):
            raise RuntimeError("a bug")

    srv, url = serve_in_thread(Broken(), tokenizer=tok)
    try:
        r = _post(url + "/v1/completions", json={"prompt": [5]})
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "internal server error (RuntimeError)", "type": "internal_error", "param": None,
            "code": 500}
        assert _get(url + "/health").json()["status"] == "ok"
    finally:
        srv.shutdown()
