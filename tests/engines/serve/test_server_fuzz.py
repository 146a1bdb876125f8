"""saorl serve fuzzed from its own OpenAPI document (schemathesis): requests that fit the schema and
requests that break it, boundary values first, sent over loopback to the real server. No answer may
be a 5xx (the requests come one at a time, so not even a 503 has a reason to happen), and every
refusal must be an OpenAI-style JSON error with its status as ``code``.

The server is the real one (routes, validation, limits, tokenizer, chat template); the engine
behind it samples without a model (:class:`InstantEngine`), so the ~1,200 requests take about 10 s
on two cores, and checks each request as the local engine does (``validate_request``: token ids in
range, the prompt within ``max_seq_len``). Deterministic: a fixed seed and derandomised generation
(the same requests, the same answers, run after run). Run with ``-s`` for the count of answers per
route and status."""

import asyncio
import collections
import time

import pytest
import schemathesis

from saorl.engines.base import GenerationResult
from saorl.engines.request import validate_request
from saorl.engines.serve.server import ServerLimits, ServerThread, create_app

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


class InstantEngine:
    """Samples token ``(last + 1) % vocab`` with log-prob -1, instantly; stops as the local engine
    does (a stop token id, a stop string in the decoded text, ``max_new_tokens``, ``max_seq_len``)."""

    version = 0

    def __init__(self, tokenizer, vocab_size: int, max_seq_len: int = 64) -> None:
        self.tokenizer, self.vocab_size, self.max_seq_len = tokenizer, vocab_size, max_seq_len

    async def agenerate(self, prompt_ids, params, *, on_token=None):
        validate_request(prompt_ids, params, self.vocab_size, self.max_seq_len)
        tokens, finish, stop = [], "length", None
        while len(tokens) < params.max_new_tokens and len(prompt_ids) + len(tokens) < self.max_seq_len:
            t = ((tokens or prompt_ids)[-1] + 1) % self.vocab_size
            tokens.append(t)
            alts = [(t, -1.0)] * params.top_logprobs if params.top_logprobs else None
            if on_token is not None:
                on_token(t, -1.0, 0, alts)
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
            hit = next((s for s in params.stop if s in text), None)
            if t in params.stop_token_ids or hit is not None:
                finish, stop = "stop", t if t in params.stop_token_ids else hit
                break
        await asyncio.sleep(0)
        top = [[(t, -1.0)] * params.top_logprobs for t in tokens] if params.top_logprobs else None
        return GenerationResult(tokens, [-1.0] * len(tokens), finish, [0] * len(tokens), stop, {}, top)


SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
CONFIG = schemathesis.Config.from_dict({
    "seed": 20261201,
    "generation": {"max-examples": 200, "deterministic": True},
    "phases": {"stateful": {"enabled": False}},
})
# the document depends on the routes only: any app gives it, at collection time
schema = schemathesis.openapi.from_dict(create_app(InstantEngine(None, 1)).openapi(), config=CONFIG)


@pytest.fixture(scope="module")
def url(tok, tmp_path_factory):
    tok.chat_template = TEMPLATE
    wdir = tmp_path_factory.mktemp("weights")
    (wdir / "notes.txt").write_text("not weights\n")
    app = create_app(InstantEngine(tok, len(tok)), tokenizer=tok, model_name="tiny", weights_dir=wdir,
                     limits=ServerLimits(max_pending=64, header_timeout_s=5.0))
    srv = ServerThread(app)
    started = time.monotonic()
    yield srv.url
    srv.shutdown()
    tok.chat_template = None
    print(f"\nfuzzed in {time.monotonic() - started:.1f}s: "
          + "; ".join(f"{k}: {dict(sorted(v.items()))}" for k, v in sorted(SEEN.items())))


@schema.parametrize()
def test_no_request_is_answered_500_and_every_refusal_is_a_json_error(case, url):
    response = case.call(base_url=url, timeout=30)
    SEEN[f"{case.method} {case.path}"][response.status_code] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
    if response.status_code >= 400:
        err = response.json()["error"]
        assert err["code"] == response.status_code and err["message"] and err["type"], err
