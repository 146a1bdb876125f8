"""saorl serve against clients that go away and bodies that take long to read, on loopback: a
request whose client disconnects is cancelled within about a second on every generation route
(streamed or not), and the event loop stays free while large bodies are parsed and tokenized
(``/health`` answers within 100 ms meanwhile)."""

import functools
import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from saorl.engines import LocalEngine
from saorl.engines.serve.server import ServerLimits, serve_in_thread
from saorl.models.tiny import build_tiny

_post = functools.partial(httpx.post, timeout=60)
_get = functools.partial(httpx.get, timeout=60)


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _server(tok, emulate=None, max_model_len=None):
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = TEMPLATE
    eng = LocalEngine(build_tiny("tiny-dense", seed=0), tok, max_batch_size=64, stop_on_eos=False,
                      max_seq_len=max_model_len or 4096)
    srv, url = serve_in_thread(eng, tokenizer=tok, limits=ServerLimits(max_pending=256), emulate=emulate)
    return eng, srv, url


@pytest.fixture()
def served(tok):
    eng, srv, url = _server(tok)
    yield eng, url
    srv.shutdown()
    eng.close()


@pytest.fixture()
def served_sglang(tok):
    eng, srv, url = _server(tok, emulate="sglang")
    yield eng, url
    srv.shutdown()
    eng.close()


def _running(url: str) -> int:
    text = _get(f"{url}/metrics").text
    return int(float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1)))


def _aborted(url: str) -> float:
    """``/metrics``' count of choices finished by ``abort``."""
    text = _get(f"{url}/metrics").text
    return float(re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"\} (\S+)$', text,
                           re.M).group(1))


def _send_and_leave(url: str, path: str, body: dict, after_s: float) -> None:
    """POST ``body`` on a raw socket, then close it once the engine has been working on it for
    ``after_s``, without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 10
        while _running(url) == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        time.sleep(after_s)


@pytest.fixture()
def server_errors():
    """What the server logs as errors (an exception in a route, its handler included)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _cancelled_within(url: str, left_at: float, bound_s: float) -> float:
    while _running(url) > 0:
        assert time.monotonic() - left_at < bound_s, f"{_running(url)} still running {bound_s} s on"
        time.sleep(0.05)
    return time.monotonic() - left_at


BIG = {"prompt": [1, 2], "n": 32, "max_tokens": 4000, "temperature": 1.0}
ROUTES = {
    "completions": ("/v1/completions", BIG),
    "completions, streamed": ("/v1/completions", {**BIG, "stream": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 32,
                                       "max_tokens": 4000, "temperature": 1.0}),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_request_whose_client_left_is_cancelled_within_a_second(served, route, server_errors):
    _, url = served
    path, body = ROUTES[route]
    _send_and_leave(url, path, body, 1.0)
    left = time.monotonic()
    took = _cancelled_within(url, left, 3.0)
    assert took < 1.5, took
    deadline = time.monotonic() + 2.0  # and counted: each of its 32 choices finished by abort
    while _aborted(url) != 32 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(url) == 32, _get(f"{url}/metrics").text
    t0 = time.monotonic()  # and the engine is free for the next one at once
    r = _post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - t0 < 5.0
    assert not server_errors, server_errors  # its answer (a 499 nobody reads) raised nothing


def test_an_sglang_generate_whose_client_left_is_cancelled(served_sglang, server_errors):
    _, url = served_sglang
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4000, "temperature": 1.0}}
    _send_and_leave(url, "/generate", body, 1.0)
    assert _cancelled_within(url, time.monotonic(), 3.0) < 1.5
    assert _aborted(url) == 1
    assert not server_errors, server_errors


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            c.get(f"{url}/health")
            out.append(time.monotonic() - t0)
            time.sleep(0.01)


# /health's answer while a body is read: under 100 ms at the median, and never a stall of the
# event loop (before: 11.8 s to 15.7 s). The bound on the slowest answer is loose because the
# 2-core CI machine runs other jobs (a load average of 10 was measured here, where even an idle
# server's median answer took 45 ms); what it rules out is the loop blocked for the whole read.
MEDIAN_S, SLOWEST_S = 0.1, 1.0


def _while_health_is_polled(url: str, fn, min_polls: int = 6) -> tuple[object, float, float]:
    """``fn()``'s result while another thread polls /health; the median and the slowest answer.

    ``min_polls`` makes sure the polls overlapped the work; a request that is meant to be
    answered quickly (a refusal) asks for fewer, since how many fit depends on the machine."""
    stop, lat = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(url, stop, lat))
    poller.start()
    time.sleep(0.2)
    try:
        result = fn()
    finally:
        stop.set()
        poller.join()
    assert len(lat) >= min_polls, lat
    return result, sorted(lat)[len(lat) // 2], max(lat)


def test_health_answers_within_100_ms_while_a_4_mb_prompt_is_tokenized(served, tok):
    _, url = served
    text = "the sweet moon, " * (3_900_000 // 16)  # 3.9 MB of text: seconds of tokenizing
    data = json.dumps({"prompt": text}).encode()  # (encoded here first: the client shares our GIL)
    r, median, slowest = _while_health_is_polled(url, lambda: _post(f"{url}/tokenize", content=data))
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert r.json()["tokens"] == tok.encode(text)  # (the slice-wise encoding is the same JSON)
    assert median < MEDIAN_S and slowest < SLOWEST_S, (median, slowest)


def test_prompts_too_long_are_refused_before_all_are_tokenized_and_health_answers(tok):
    eng, srv, url = _server(tok, max_model_len=1024)
    try:
        prompts = ["the sweet moon, " * (60_000 // 16)] * 64
        data = json.dumps({"prompt": prompts, "max_tokens": 4}).encode()
        t0 = time.monotonic()
        r, median, slowest = _while_health_is_polled(  # (a quick refusal leaves room for few polls)
            url, lambda: _post(f"{url}/v1/completions", content=data), min_polls=2)
        took = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens", r.text
        assert "prompt 0 has" in r.json()["error"]["message"]
        assert median < MEDIAN_S and slowest < SLOWEST_S and took < 3.0, (median, slowest, took)
    finally:
        srv.shutdown()
        eng.close()
