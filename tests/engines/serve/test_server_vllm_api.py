"""saorl serve speaks vLLM 0.32's OpenAI API: served names, the context and generation_config.json
defaults, usage, stop reasons, the vLLM fields at neutral values, chat rendering, streams of one
event per token, and the tokenizer / version / metrics routes (against vLLM itself:
tests/vllm/test_vllm_serve_parity.py)."""

import json

import httpx
import pytest

from saorl.engines import LocalEngine
from saorl.engines.serve.served import ServedModel, generation_defaults, unhonoured_default
from saorl.engines.serve.server import serve_in_thread
from saorl.models.tiny import build_tiny

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{{ greeting | default('') }}{% endif %}")
M = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok_chat():
    from saorl.models.tokenizer import load_tokenizer

    t = load_tokenizer()
    t.chat_template = TEMPLATE
    return t


def _serve(tok, **served):
    eng = LocalEngine(build_tiny("tiny-dense", seed=0), tok, max_batch_size=4, max_seq_len=64)
    kw = dict(names=("policy", "alias"), root="/models/x", max_model_len=64, eos_token_id=tok.eos_token_id)
    srv, url = serve_in_thread(eng, tokenizer=tok, served=ServedModel(**(kw | served)))
    return eng, srv, url


@pytest.fixture(scope="module")
def url(tok_chat):
    eng, srv, url = _serve(tok_chat, defaults={"max_tokens": 5})
    yield url
    srv.shutdown()
    eng.close()


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def test_names_404_and_the_first_name_in_responses(url):
    for model in ("policy", "alias", None):
        r = _post(url, "/v1/completions", {"model": model, "prompt": [5], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "policy"
    r = _post(url, "/v1/completions", {"model": "nope", "prompt": [5]})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `nope` does not exist. Valid aliases: policy, alias.", "type": "NotFoundError",
        "param": "model", "code": 404}
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["policy", "alias"] and {m["max_model_len"] for m in models} == {64}


def test_usage_counts_each_prompt_once_and_every_sampled_token(url):
    out = _post(url, "/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], "n": 3, "max_tokens": 4, "seed": 1,
                                         "return_token_ids": True}).json()
    use = out["usage"]
    assert use["prompt_tokens"] == 5  # each prompt once, not n times
    assert use["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    assert use["total_tokens"] == 5 + use["completion_tokens"] and len(out["choices"]) == 6
    assert [c["prompt_token_ids"] for c in out["choices"]] == [[5, 6]] * 3 + [[7, 8, 9]] * 3


def test_budgets_follow_the_context_and_generation_config(url, tok_chat):
    r = _post(url, "/v1/completions", {"prompt": [5] * 60, "max_tokens": 10, "return_token_ids": True,
                                       "stop_token_ids": [0]})
    c = r.json()["choices"][0]
    assert len(c["token_ids"]) <= 4 and (c["finish_reason"] == "length") == (len(c["token_ids"]) == 4)
    r = _post(url, "/v1/completions", {"prompt": [5] * 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = _post(url, "/v1/completions", {"prompt": [5] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens"
    # chat: generation_config's max_new_tokens (5 here), else what the context leaves
    r = _post(url, "/v1/chat/completions", {"messages": M, "return_token_ids": True}).json()["choices"][0]
    assert len(r["token_ids"]) <= 5
    eng, srv, other = _serve(tok_chat)
    try:
        prompt = len(tok_chat.apply_chat_template(M, add_generation_prompt=True, tokenize=True)["input_ids"])
        r = _post(other, "/v1/chat/completions", {"messages": M, "return_token_ids": True}).json()
        assert r["usage"]["prompt_tokens"] == prompt and r["usage"]["completion_tokens"] <= 64 - prompt
    finally:
        srv.shutdown()
        eng.close()


def test_generation_config_defaults_as_vllm_reads_them(tmp_path, tok_chat):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 20, "max_new_tokens": 7, "eos_token_id": [0, 9], "do_sample": True}))
    defaults, eos = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.0, "top_k": 20, "max_tokens": 7} and eos == (0, 9)
    assert generation_defaults(tmp_path, "vllm") == ({}, ())
    assert unhonoured_default(defaults) is None
    assert "repetition_penalty=1.1" in unhonoured_default({"repetition_penalty": 1.1})
    assert unhonoured_default({"repetition_penalty": 1.0, "min_p": 0.0}) is None
    assert "top_p must be in (0, 1]" in unhonoured_default({"top_p": 0.0})
    # temperature 0 by default: greedy, so every unseeded request gives the same tokens; EOS id 9 stops
    eng, srv, u = _serve(tok_chat, defaults=defaults, extra_eos=(9,))
    try:
        body = {"prompt": [5, 6], "max_tokens": 6, "return_token_ids": True}
        a, b = (_post(u, "/v1/completions", body).json() for _ in range(2))
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        r = _post(u, "/v1/completions", {"prompt": [5, 6], "max_tokens": 6, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # greedy n > 1, as in vLLM
    finally:
        srv.shutdown()
        eng.close()


def test_stop_reason_is_null_at_the_eos_and_names_a_stop_token(url):
    seen = set()
    for seed in range(40):
        body = {"prompt": [5], "max_tokens": 3, "seed": seed, "return_token_ids": True,
                "stop_token_ids": list(range(100, 164))}
        c = _post(url, "/v1/completions", body).json()["choices"][0]
        if c["finish_reason"] == "stop":
            last = c["token_ids"][-1]
            assert c["stop_reason"] == (None if last == 0 else last), c
            seen.add("eos" if last == 0 else "token")
        else:
            assert c["stop_reason"] is None
    assert "token" in seen


@pytest.mark.parametrize("field, neutral, other", [
    ("presence_penalty", 0.0, 0.5), ("frequency_penalty", 0, -1.0), ("repetition_penalty", 1.0, 1.2),
    ("min_p", 0.0, 0.1), ("logit_bias", {"5": 0}, {"5": 2.0}), ("min_tokens", 0, 2),
    ("ignore_eos", False, True), ("use_beam_search", False, True), ("bad_words", [], ["x"]),
    ("response_format", {"type": "text"}, {"type": "json_object"}),
    ("echo", False, True), ("priority", 0, 1), ("prompt_logprobs", None, 1),
])
def test_vllm_fields_at_neutral_values_pass_and_others_are_400s_naming_them(url, field, neutral, other):
    for path, base in (("/v1/completions", {"prompt": [5]}), ("/v1/chat/completions", {"messages": M})):
        assert _post(url, path, base | {"max_tokens": 1, field: neutral}).status_code == 200
        r = _post(url, path, base | {"max_tokens": 1, field: other})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = _post(url, "/v1/chat/completions", {"messages": M, "max_tokens": 1, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_chat_parts_generation_prompt_continuation_and_template_kwargs(url, tok_chat):
    def tokens(**kw):
        r = _post(url, "/tokenize", kw)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokens(messages=parts) == tokens(messages=[{"role": "user", "content": "a\nb"}])
    assert tok_chat.decode(tokens(messages=M, add_generation_prompt=False)) == "<|user|>hi\n"
    cont = [*M, {"role": "assistant", "content": "hel"}]
    assert tok_chat.decode(tokens(messages=cont, add_generation_prompt=False, continue_final_message=True)) \
        == "<|user|>hi\n<|assistant|>hel"
    assert tok_chat.decode(tokens(messages=M, chat_template_kwargs={"greeting": "yo", "tokenize": True})) \
        == "<|user|>hi\n<|assistant|>yo"
    out = _post(url, "/v1/chat/completions", {"messages": M, "max_tokens": 1, "add_generation_prompt": False,
                                              "return_token_ids": True}).json()
    assert out["choices"][0]["message"]["role"] == "user" and out["prompt_token_ids"] == tokens(
        messages=M, add_generation_prompt=False)
    for body, param in [({"messages": cont, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages")]:
        r = _post(url, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_is_one_event_per_token_with_the_finish_on_the_last(url, chat):
    body = {"max_tokens": 6, "n": 2, "seed": 3, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    body |= {"messages": M} if chat else {"prompt": [5, 6]}
    with httpx.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
    if chat:
        assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
        events = events[2:]
    *tokens, usage = events
    for i in range(2):
        mine = [e["choices"][0] for e in tokens if e["choices"][0]["index"] == i]
        assert all(len(c["token_ids"]) == 1 for c in mine)
        assert [c["finish_reason"] is None for c in mine] == [True] * (len(mine) - 1) + [False]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)
    assert "system_fingerprint" in usage and usage["usage"]["prompt_tokens"] == (
        len(_post(url, "/tokenize", {"messages": M}).json()["tokens"]) if chat else 2)


def test_tokenize_detokenize_version_and_metrics(url, tok_chat):
    t = _post(url, "/tokenize", {"prompt": "the sweet moon", "return_token_strs": True}).json()
    assert t == {"count": 3, "max_model_len": 64, "tokens": tok_chat.encode("the sweet moon"),
                 "token_strs": tok_chat.convert_ids_to_tokens(tok_chat.encode("the sweet moon"))}
    assert _post(url, "/detokenize", {"tokens": [5, 1, 10**9]}).json() == {"prompt": tok_chat.decode([5, 1])}
    assert _post(url, "/detokenize", {"model": "nope", "tokens": [5]}).status_code == 404
    from saorl import __version__

    assert httpx.get(url + "/version").json() == {"version": __version__}
    text = httpx.get(url + "/metrics").text
    assert '# TYPE vllm:generation_tokens_total counter' in text
    assert 'vllm:request_success_total{engine="0",model_name="policy",finished_reason="length"}' in text
    done = next(line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))
    assert float(done.rsplit(" ", 1)[1]) > 0
