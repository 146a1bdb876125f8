"""``saorl serve`` against the real vLLM 0.32 OpenAI server, started on the same tiny model directory:
the same requests to both, the answers compared field by field.

Compared: status codes; every key of every object (responses, choices, messages, logprobs, usage,
stream events, errors, tokenizer and model routes); the JSON type of every value; null against
not-null; the deterministic values (``object``, ``model``, prompt token counts and ids, choice
indices and counts, tokenizer routes, the 404's message, error ``type`` and ``code``); and, on each
server by itself, the semantics of what depends on sampling: usage arithmetic, ``finish_reason`` /
``stop_reason`` (a ``length`` choice has all its budget and no stop reason; a ``stop`` choice ends at
the EOS with ``stop_reason: null``, at a stop token it names, or before a stop string it names),
one stream event per token with the finish on the last, the usage event. Sampled values (text,
token ids, log-probs) are compared for type only: the two samplers draw differently.

:data:`INTENTIONAL` lists every place where saorl differs on purpose, and why; the test fails on any
other difference, and prints its figures (``RESULT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
LONG = "the sweet moon " * 333  # 1014 chat prompt tokens: 10 left of the 1024 context
M = [{"role": "user", "content": "hi"}]
STOP_IDS = list(range(300, 364))
NEUTRAL = dict(presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0, min_p=0.0, logit_bias={},
               min_tokens=0, ignore_eos=False, skip_special_tokens=True, spaces_between_special_tokens=True,
               priority=0, use_beam_search=False, length_penalty=1.0, bad_words=[], allowed_token_ids=None,
               prompt_logprobs=None, truncate_prompt_tokens=None, response_format={"type": "text"})

INTENTIONAL = {
    "extension keys": "each choice's `versions` and the response's `saorl` (the weight version of every "
                      "token, which saorl's HTTP engine reads; left out with --emulate)",
    "unknown fields": "a field vLLM does not know is a 400 naming it (vLLM ignores it): a misspelt field "
                      "is never silently dropped",
    "unhonoured values": "a penalty, min_p, logit_bias, ... set to a non-neutral value is a 400 naming it: "
                         "the engine samples with temperature, top-k and top-p only (vLLM applies them)",
    "schema-level 400s": "type `BadRequestError` and `param` the field's name, with a one-line message "
                         "(vLLM: `Bad Request`, `body.<field>`, a pydantic dump)",
    "param of other 400s": "saorl names the field where vLLM's param is null (n, prompt, messages, "
                           "continue_final_message)",
    "error messages": "worded by saorl (compared for type), except the unknown model's 404",
    "unknown routes": "a JSON error in saorl's one shape (vLLM: FastAPI's {\"detail\": ...})",
    "chat top_logprobs": "the k most likely tokens (OpenAI's definition); vLLM 0.32 lists the sampled "
                         "token first and then the k-1 most likely (same shape)",
    "size bounds": "saorl's own bounds, a 400 past them: n <= 64, <= 64 prompts, <= 16 stop strings (vLLM "
                   "4), <= 64 stop token ids, <= 1024 messages; vLLM's bounds differ",
    "identity values": "id suffixes, system_fingerprint (saorl-<version>-...), owned_by (saorl), "
                       "/version (saorl's version), /health's body, the metrics saorl has not",
}
"""Where saorl serve differs from vLLM on purpose; docs/engines.md lists the same."""

DATA_KEYS = ("top_logprobs",)  # completions: dicts keyed by decoded tokens, which sampling picks
STATS = {"requests": 0, "fields": 0}


# ------------------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def saorl_url(models, tmp_path_factory):
    """``saorl serve`` on the dense policy's directory, with vLLM's names and context."""
    log = tmp_path_factory.mktemp("saorl-serve") / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "saorl.cli", "serve", "--model", str(models["dense"]), "--port", "0",
           "--served-model-name", "policy", "--max-model-len", "1024"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("saorl serve: listening on "), (line, log.read_text()[-2000:])
        yield line.split("listening on ")[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def both(dense_server, saorl_url):
    clients = {"vllm": httpx.Client(base_url=dense_server.url, timeout=120),
               "saorl": httpx.Client(base_url=saorl_url, timeout=120)}
    yield clients
    for c in clients.values():
        c.close()


def _ask(both, method: str, path: str, body=None, stream: bool = False, raw: bytes | None = None):
    """The same request to both servers: ``{server: (status, JSON body or list of events)}``."""
    out = {}
    for name, c in both.items():
        STATS["requests"] += 1
        kw = {"content": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else (
            {"json": body} if body is not None else {})
        if stream:
            with c.stream(method, path, **kw) as r:
                lines = [x for x in r.iter_lines() if x]
                if r.headers["content-type"].startswith("text/event-stream"):
                    assert lines[-1] == "data: [DONE]", lines[-3:]
                    out[name] = (r.status_code, [json.loads(x.removeprefix("data: ")) for x in lines[:-1]])
                else:
                    out[name] = (r.status_code, json.loads("".join(lines)))
        else:
            r = c.request(method, path, **kw)
            out[name] = (r.status_code, r.json() if r.content else None)
    return out


# ------------------------------------------------------------------------------------- shapes
def _kind(x) -> str:
    return "null" if x is None else type(x).__name__


def same_shape(a, b, path: str = "") -> list[str]:
    """Differences between vLLM's ``a`` and saorl's ``b``: keys, JSON types, null or not; lists
    pairwise over their common length (their lengths follow sampling), dicts keyed by sampled tokens
    by value type only. saorl's extension keys are allowed (:data:`INTENTIONAL`)."""
    STATS["fields"] += 1
    if isinstance(a, dict) and isinstance(b, dict):
        if path.rsplit(".", 1)[-1].rstrip("[]0123456789") in DATA_KEYS and not path.startswith("chat"):
            return [d for x in list(a.values())[:1] for y in list(b.values())[:1]
                    for d in same_shape(x, y, path + ".*")]
        extra = set(b) - set(a) - {"versions", "saorl"}
        diffs = [f"{path}: saorl lacks {sorted(set(a) - set(b))}"] if set(a) - set(b) else []
        diffs += [f"{path}: saorl adds {sorted(extra)}"] if extra else []
        return diffs + [d for k in a.keys() & b.keys() for d in same_shape(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_shape(x, y, f"{path}[{i}]")]
    if _kind(a) != _kind(b) and not (path.endswith("stop_reason")):  # stop_reason: checked by meaning
        return [f"{path}: vLLM {_kind(a)} {str(a)[:40]!r}, saorl {_kind(b)} {str(b)[:40]!r}"]
    return []


def same_error(got, status: int, param: str | None = "any", path: str = "", alias: str | None = None) -> None:
    """Both answered ``status`` with an error ``{message, type, param, code}``; ``param`` is saorl's
    (vLLM's is the same, ``body.<it>``, ``alias``, or null where saorl names the field)."""
    (sv, v), (ss, s) = got["vllm"], got["saorl"]
    assert sv == ss == status, (path, sv, v, ss, s)
    keys = {"message", "type", "param", "code"}
    assert set(v) == set(s) == {"error"} and set(v["error"]) == set(s["error"]) == keys, (v, s)
    assert v["error"]["code"] == s["error"]["code"] == status and isinstance(s["error"]["message"], str)
    assert s["error"]["type"] == v["error"]["type"] or v["error"]["type"] == "Bad Request", (v, s)
    if param != "any":
        assert s["error"]["param"] == param, s
        assert v["error"]["param"] in (param, f"body.{param}", alias, None), v
    STATS["fields"] += 5


def _tokens(choice: dict) -> list | None:
    if choice.get("token_ids") is not None:
        return choice["token_ids"]
    lp = choice.get("logprobs")
    return None if lp is None else lp["tokens"] if "tokens" in lp else lp["content"]


def check_meaning(body: dict, req: dict, budget: int, chat: bool) -> None:
    """One server's answer by itself: usage arithmetic and finish / stop reasons (module docstring)."""
    use = body["usage"]
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"], use
    lengths = []
    for c in body["choices"]:
        text = c["message"]["content"] if chat else c["text"]
        tokens = _tokens(c)
        lengths.append(None if tokens is None else len(tokens))
        if c["finish_reason"] == "length":
            assert c["stop_reason"] is None and (tokens is None or len(tokens) == budget), c
        else:
            assert c["finish_reason"] == "stop", c
            stop = c["stop_reason"]
            if isinstance(stop, str):
                assert stop in (req.get("stop") or []) and (req.get("include_stop_str_in_output")
                                                            or stop not in text), c
            elif isinstance(stop, int):
                assert stop in req.get("stop_token_ids", []) and (tokens is None or c.get("token_ids") is None
                                                                  or tokens[-1] == stop), c
            else:  # the EOS
                assert stop is None and (c.get("token_ids") is None or c["token_ids"][-1] == 0), c
    if None not in lengths:
        assert use["completion_tokens"] == sum(lengths), (use, lengths)


def compare(got, req: dict | None = None, budget: int | None = None, chat: bool = False) -> dict:
    (sv, v), (ss, s) = got["vllm"], got["saorl"]
    assert sv == ss == 200, (sv, str(v)[:300], ss, str(s)[:300])
    diffs = same_shape(v, s, "chat" if chat else "cmpl")
    assert not diffs, diffs
    if req is not None:
        for body in (v, s):
            check_meaning(body, req, budget, chat)
            assert body["object"] == ("chat.completion" if chat else "text_completion")
            assert body["model"] == "policy" and body["id"].startswith("chatcmpl-" if chat else "cmpl-")
        assert v["usage"]["prompt_tokens"] == s["usage"]["prompt_tokens"]
        assert [c["index"] for c in v["choices"]] == [c["index"] for c in s["choices"]]
        STATS["fields"] += 4
    return v, s


def compare_stream(got, req: dict, chat: bool) -> None:
    """Events: the opening (chat), one per token and choice with the finish on the last, the usage."""
    shapes = {}
    for name, (status, events) in got.items():
        assert status == 200, (name, events)
        n = req.get("n", 1)
        opening = events[:n] if chat else []
        assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in opening), opening
        body = [e for e in events[len(opening):] if e["choices"]]
        usage = [e for e in events if not e["choices"]]
        per = {i: [e for e in body if e["choices"][0]["index"] == i] for i in range(n)}
        tokens = 0
        for evs in per.values():
            ends = [e["choices"][0]["finish_reason"] is not None for e in evs]
            assert ends == [False] * (len(evs) - 1) + [True], (name, evs)
            if req.get("return_token_ids"):  # one token an event (vLLM may merge two under load)
                sizes = [len(e["choices"][0]["token_ids"]) for e in evs]
                assert all(k == 1 for k in sizes) if name == "saorl" else all(k >= 1 for k in sizes), sizes
                tokens += sum(sizes)
        if req.get("stream_options", {}).get("include_usage"):
            (u,) = usage
            assert not req.get("return_token_ids") or u["usage"]["completion_tokens"] == tokens, (name, u)
            assert set(u["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens"}
        shapes[name] = (opening[:1], per[0][:1] if len(per[0]) > 1 else [], per[0][-1:], usage)
    parts = ("opening", "token event", "final event", "usage")
    for part, a, b in zip(parts, shapes["vllm"], shapes["saorl"]):
        diffs = same_shape(a, b, f"{'chat' if chat else 'cmpl'} stream {part}")
        assert not diffs, diffs


# ------------------------------------------------------------------------------------- the requests
def test_completions_match_vllms(both):
    for req, budget in [
        (dict(model="policy", prompt="the sweet moon", max_tokens=5, seed=1), 5),
        (dict(prompt=[5, 6, 7], max_tokens=6, n=2, logprobs=2, seed=1, stop=["e"], return_token_ids=True), 6),
        (dict(prompt=[[5, 6], [7, 8, 9]], max_tokens=3, n=2, seed=2, return_token_ids=True), 3),
        (dict(prompt=[5, 6, 7], max_tokens=4, logprobs=0, return_tokens_as_token_ids=True, seed=3), 4),
        (dict(prompt=[5, 6, 7], max_tokens=8, stop=[" "], include_stop_str_in_output=True, seed=4), 8),
        (dict(prompt=[5, 6, 7], max_tokens=16, stop_token_ids=STOP_IDS, return_token_ids=True, seed=5), 16),
        (dict(prompt=[5, 6, 7], seed=6, return_token_ids=True, **NEUTRAL), 16),  # max_tokens: 16
        (dict(prompt=[5] * 1020, max_tokens=10, seed=7, return_token_ids=True), 4),  # what the context leaves
    ]:
        compare(_ask(both, "POST", "/v1/completions", req), req, budget)
    got = _ask(both, "POST", "/v1/completions", dict(prompt=[5], max_tokens=1, request_id="parity-1"))
    assert got["vllm"][1]["id"] == got["saorl"][1]["id"] == "cmpl-parity-1"


def test_chat_matches_vllms(both):
    cases = [
        (dict(model="policy", messages=M, max_tokens=4, seed=1, logprobs=True, top_logprobs=2), 4),
        (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                 "text": "b"}]}],
              max_tokens=2, seed=1, return_token_ids=True), 2),
        (dict(messages=M, max_tokens=2, add_generation_prompt=False, return_token_ids=True, seed=1), 2),
        (dict(messages=[*M, {"role": "assistant", "content": "hel"}], max_tokens=2,
              add_generation_prompt=False, continue_final_message=True, return_token_ids=True, seed=1), 2),
        (dict(messages=M, max_tokens=2, chat_template_kwargs={"greeting": "Hello there", "unused": 1},
              return_token_ids=True, seed=1), 2),
        (dict(messages=M, max_completion_tokens=3, n=2, stop=[" "], seed=5, tool_choice="none", **NEUTRAL),
         3),
        # no max_tokens: what the context leaves
        (dict(messages=[{"role": "user", "content": LONG}], seed=1, return_token_ids=True), 10),
    ]
    for req, budget in cases:
        v, s = compare(_ask(both, "POST", "/v1/chat/completions", req), req, budget, chat=True)
        role = "assistant" if req.get("add_generation_prompt", True) else req["messages"][-1]["role"]
        assert v["choices"][0]["message"]["role"] == s["choices"][0]["message"]["role"] == role
        if req.get("return_token_ids"):
            tokenized = _ask(both, "POST", "/tokenize", {k: req[k] for k in req if k in (
                "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")})
            assert tokenized["vllm"] == tokenized["saorl"]
            assert v["prompt_token_ids"] == s["prompt_token_ids"] == tokenized["saorl"][1]["tokens"]


def test_streams_match_vllms(both):
    usage = {"include_usage": True}
    for path, req, chat in [
        ("/v1/completions", dict(prompt=[5, 6, 7], max_tokens=3, n=2, seed=1, logprobs=1, stream=True,
                                 stream_options=usage, return_token_ids=True), False),
        ("/v1/completions", dict(prompt="ab", max_tokens=4, seed=1, stream=True, stop=["e"]), False),
        ("/v1/completions", dict(prompt="ab", max_tokens=2, seed=1, stream=True,
                                 stream_options=usage | {"continuous_usage_stats": True}), False),
        ("/v1/chat/completions", dict(messages=M, max_tokens=3, n=2, seed=1, logprobs=True, top_logprobs=1,
                                      stream=True, stream_options=usage, return_token_ids=True), True),
        ("/v1/chat/completions", dict(messages=M, max_tokens=2, seed=1, stream=True), True),
    ]:
        compare_stream(_ask(both, "POST", path, req, stream=True), req, chat)
    nope = dict(model="nope", prompt="ab", stream=True)
    same_error(_ask(both, "POST", "/v1/completions", nope, stream=True), 404, "model")


def test_refusals_match_vllms(both):
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    for path, body, status, param, *alias in [
        (cmpl, dict(model="nope", prompt=[5]), 404, "model"),
        (chat, dict(model="nope", messages=M), 404, "model"),
        (cmpl, dict(prompt=[5] * 1024, max_tokens=2), 400, "max_tokens"),
        (cmpl, dict(prompt=[5] * 1025, max_tokens=2), 400, "input_tokens"),
        (chat, dict(messages=[{"role": "user", "content": LONG * 2}]), 400, "input_tokens"),
        (cmpl, dict(prompt=[5], max_tokens=2, temperature=0, n=2), 400, "n"),
        (cmpl, dict(prompt=[5], temperature="hot"), 400, "temperature"),
        (cmpl, dict(prompt=[5], max_tokens=-1), 400, "max_tokens"),
        (cmpl, dict(prompt=[5], top_p=0), 400, "top_p"),
        (cmpl, dict(prompt=[5], n=0), 400, "n"),
        (cmpl, dict(prompt=[5], logprobs=50), 400, "logprobs"),
        (cmpl, dict(prompt=[5], stream_options={"include_usage": True}), 400, "stream_options"),
        (cmpl, dict(prompt=[]), 400, "prompt"),
        (cmpl, dict(max_tokens=2), 400, "prompt"),
        (cmpl, dict(prompt=[5, 1_000_000]), 400, "prompt"),
        (chat, dict(messages=[]), 400, "messages"),
        (chat, dict(messages=M, top_logprobs=2), 400, "top_logprobs"),
        (chat, dict(messages=M, max_completion_tokens=0), 400, "max_completion_tokens", "max_tokens"),
        (chat, dict(messages=[*M, {"role": "assistant", "content": "x"}], continue_final_message=True), 400,
         "continue_final_message"),
        (chat, dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                            "image_url": {"url": "x"}}]}]), 400, "messages"),
        ("/tokenize", dict(model="nope", prompt="x"), 404, "model"),
    ]:
        same_error(_ask(both, "POST", path, body), status, param, str(body)[:60], *alias)
    got = _ask(both, "POST", "/v1/completions", raw=b"{nope")
    same_error(got, 400)
    nope = _ask(both, "POST", "/v1/completions", dict(model="nope", prompt=[5]))
    assert nope["vllm"][1]["error"]["message"] == nope["saorl"][1]["error"]["message"]


def test_the_intentional_differences_are_what_the_docs_say(both):
    """The rows of :data:`INTENTIONAL` that a request shows: vLLM accepts, saorl refuses naming the field."""
    for body, field in [(dict(prompt=[5], max_tokens=1, foo=1), "foo"),
                        (dict(prompt=[5], max_tokens=1, presence_penalty=0.5), "presence_penalty"),
                        (dict(prompt=[5], max_tokens=1, logit_bias={"5": 3}), "logit_bias")]:
        got = _ask(both, "POST", "/v1/completions", body)
        assert got["vllm"][0] == 200 and got["saorl"][0] == 400 and got["saorl"][1]["error"]["param"] == field
    (sv, v), (ss, s) = _ask(both, "GET", "/nothere").values()
    assert sv == ss == 404 and set(v) == {"detail"} and set(s) == {"error"}


def test_tokenizer_model_and_version_routes_match_vllms(both):
    for body in [dict(prompt="the sweet moon", return_token_strs=True),
                 dict(prompt="ab", add_special_tokens=False), dict(messages=M, return_token_strs=True),
                 dict(messages=M, add_generation_prompt=False)]:
        got = _ask(both, "POST", "/tokenize", body)
        assert got["vllm"] == got["saorl"] and got["saorl"][0] == 200, got
        STATS["fields"] += 4
    for tokens in ([5, 1, 0, 6], [10**9], []):
        got = _ask(both, "POST", "/detokenize", {"tokens": tokens})
        assert got["vllm"] == got["saorl"] and got["saorl"][0] == 200, got
        STATS["fields"] += 1
    got = _ask(both, "GET", "/v1/models")
    assert not same_shape(got["vllm"][1], got["saorl"][1], "models")
    (v,), (s,) = got["vllm"][1]["data"], got["saorl"][1]["data"]
    assert (v["id"], v["root"], v["max_model_len"]) == (s["id"], s["root"], s["max_model_len"]) == (
        "policy", v["root"], 1024)
    got = _ask(both, "GET", "/version")
    assert set(got["vllm"][1]) == set(got["saorl"][1]) == {"version"}


def test_metrics_are_vllms_names(both):
    text = {name: c.get("/metrics").text for name, c in both.items()}
    STATS["requests"] += 2
    types = {name: dict(line.split()[2:4] for line in t.splitlines() if line.startswith("# TYPE "))
             for name, t in text.items()}
    ours = {k: v for k, v in types["saorl"].items() if k.startswith("vllm:")}
    assert len(ours) >= 6 and all(types["vllm"].get(k) == v for k, v in ours.items()), (ours, types["vllm"])
    for name, t in text.items():
        done = [line for line in t.splitlines() if line.startswith("vllm:generation_tokens_total{")]
        assert float(done[0].rsplit(" ", 1)[1]) > 0, (name, done)
    STATS["fields"] += len(ours)
    print(f"\nRESULT parity: {STATS['requests']} requests, {STATS['fields']} fields compared, "
          f"{len(INTENTIONAL)} intentional differences: {', '.join(INTENTIONAL)}")
