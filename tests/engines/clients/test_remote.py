"""The vLLM and SGLang clients and the weight publisher, end to end against saorl's emulations of
those servers (real sockets on loopback, the tiny model)."""

import asyncio
import threading
import time

import httpx
import pytest
import torch

from saorl.engines import EngineError, LocalEngine, SamplingParams
from saorl.engines.clients.sglang_client import SglangAdmin, SglangEngine
from saorl.engines.clients.transport import HttpTransport
from saorl.engines.clients.vllm_client import VllmAdmin, VllmEngine
from saorl.engines.serve.server import serve_in_thread
from saorl.models.logprobs import token_logprobs
from saorl.models.tiny import build_tiny
from saorl.runtime.weights.files import FilePublisher, FileSource, WeightNames
from saorl.runtime.weights.servers import ServerCheck, ServerPublisher, WeightPublishError

PROMPT = [5, 6, 7, 8]
SLOW_REQUEST_TOKENS = 480
"""Long enough that a pause or a publication issued after a request's first tokens lands while it
still runs, even on a loaded machine (with 120 tokens, a publication on a busy 2-core CI machine
arrived after the request had finished)."""


def _emulated(tok, tmp_path, emulate, seed=0, **kw):
    eng = LocalEngine(build_tiny("tiny-moe", seed=seed), tok, max_batch_size=4, stop_on_eos=False)
    srv, url = serve_in_thread(eng, tokenizer=tok, weights_dir=tmp_path, emulate=emulate, **kw)
    return eng, srv, url


def _publisher(tmp_path, admins_of, urls, model, **kw):
    transport = HttpTransport(urls, timeout_s=60)
    files = FilePublisher(tmp_path / "weights")
    return ServerPublisher(files, admins_of(transport), transport, model, **kw)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_vllm_client_round_trip_and_logprobs_mode(tok, tmp_path, mode):
    eng, srv, url = _emulated(tok, tmp_path, "vllm", logprobs_mode=mode)
    client = VllmEngine(url)
    try:
        sp = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=8, seed=4)
        got = client.generate([PROMPT], sp)[0]
        local = eng.generate([PROMPT], sp)[0]
        assert got.token_ids == local.token_ids and got.versions == [0] * 8
        if mode == "processed_logprobs":
            assert got.logprobs == pytest.approx(local.logprobs, abs=1e-5)
        else:  # the model's own distribution, as vLLM's default returns
            ids = torch.tensor([PROMPT + got.token_ids])
            raw = token_logprobs(eng.model, ids, torch.ones_like(ids))[0, len(PROMPT):].tolist()
            assert got.logprobs == pytest.approx(raw, abs=1e-5)
            assert max(abs(a - b) for a, b in zip(got.logprobs, local.logprobs)) > 0.05
        # the wire format: token ids in, logprobs 0, token ids back, a cache salt per version
        body = client._body(PROMPT, sp, 3)
        assert (body["prompt"], body["logprobs"], body["return_token_ids"], body["cache_salt"]) == (
            PROMPT, 0, True, "saorl-w3")
        plain = httpx.post(url + "/v1/completions", json={"prompt": PROMPT}).json()["choices"][0]
        assert "versions" not in plain and plain["token_ids"] is None  # vLLM's schema, no extension
    finally:
        client.close()
        srv.shutdown()
        eng.close()


def test_vllm_publication_pause_load_label_resume_and_versions(tok, tmp_path):
    eng, srv, url = _emulated(tok, tmp_path, "vllm", logprobs_mode="processed_logprobs")
    trainer = build_tiny("tiny-moe", seed=0)
    sync = _publisher(tmp_path, lambda t: [VllmAdmin(url, t)], [url], trainer)
    client = VllmEngine(url)
    try:
        sync.publish([trainer.state_dict()], 0)
        sp = SamplingParams(temperature=0, max_new_tokens=6)
        before = client.generate([PROMPT], sp)[0]
        new = build_tiny("tiny-moe", seed=1)
        sync.publish([new.state_dict()], 1)
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}
        assert httpx.get(url + "/is_paused").json() == {"is_paused": False}  # resumed
        assert FileSource(sync.files.dir).latest()[0] == 1
        assert (tmp_path / "weights" / "hf" / "v00000001" / "config.json").is_file()
        after = client.generate([PROMPT], sp)[0]
        assert after.versions == [1] * 6 and after.token_ids != before.token_ids
        with LocalEngine(new, tok, max_batch_size=1, stop_on_eos=False) as ref:
            assert after.token_ids == ref.generate([PROMPT], sp)[0].token_ids  # the weights really moved
        for v in (2, 3):
            sync.publish([new.state_dict()], v)
        assert sorted(p.name for p in (tmp_path / "weights" / "hf").iterdir()) == ["v00000002", "v00000003"]
    finally:
        client.close()
        sync.close()
        srv.shutdown()
        eng.close()


def test_vllm_request_spanning_an_update_is_tagged_with_the_older_version(tok, tmp_path):
    eng, srv, url = _emulated(tok, tmp_path, "vllm", logprobs_mode="processed_logprobs")
    trainer = build_tiny("tiny-moe", seed=0)
    sync = _publisher(tmp_path, lambda t: [VllmAdmin(url, t)], [url], trainer)
    client = VllmEngine(url)
    try:
        sync.publish([trainer.state_dict()], 0)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", client.generate(
            [PROMPT], SamplingParams(temperature=0, max_new_tokens=300))[0]))
        t.start()
        while eng.stats()["tokens_generated"] < 5:
            time.sleep(0.005)
        sync.publish([build_tiny("tiny-moe", seed=1).state_dict()], 1)
        t.join(60)
        r = out["r"]
        assert r.versions == [0] * len(r.token_ids)  # conservative: never newer than the truth
        assert client.stats()["approximate_versions"] == 1
    finally:
        client.close()
        sync.close()
        srv.shutdown()
        eng.close()


def test_sglang_client_versions_from_spans_and_abort_continuation(tok, tmp_path):
    eng, srv, url = _emulated(tok, tmp_path, "sglang")
    trainer = build_tiny("tiny-moe", seed=0)
    sync = _publisher(tmp_path, lambda t: [SglangAdmin(url, t, "abort")], [url], trainer)
    client = SglangEngine(url)
    new = build_tiny("tiny-moe", seed=1)
    n = SLOW_REQUEST_TOKENS
    try:
        sync.publish([trainer.state_dict()], 0)
        sp = SamplingParams(temperature=0, max_new_tokens=n)
        whole = client.generate([PROMPT], sp)[0]
        assert whole.metrics["chunks"] == 1 and whole.versions == [0] * n

        # the same request, aborted mid-way by a pause(abort) and continued at the same weights
        async def interrupted():
            task = asyncio.ensure_future(client.agenerate(PROMPT, sp))
            while eng.stats()["tokens_generated"] < n + 20:
                await asyncio.sleep(0.002)
            await client.transport.call("POST", "/pause_generation", {"mode": "abort"}, url=url)
            await asyncio.sleep(0.2)
            await client.transport.call("POST", "/continue_generation", url=url)
            return await task

        cont = asyncio.run(interrupted())
        assert cont.metrics["chunks"] == 2 and client.stats()["continuations"] == 1
        assert cont.token_ids == whole.token_ids
        assert cont.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
        assert cont.versions == [0] * n and cont.finish_reason == "length"

        # aborted by a publication: the first chunk is version 0, the continuation version 1, exactly
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", client.generate([PROMPT], sp)[0]))
        t.start()
        start = eng.stats()["tokens_generated"]
        while eng.stats()["tokens_generated"] < start + 10:
            time.sleep(0.002)
        sync.publish([new.state_dict()], 1)
        t.join(60)
        r = out["r"]
        k = r.versions.index(1)
        assert 10 <= k < n and r.versions == [0] * k + [1] * (n - k)
        assert r.token_ids[:k] == whole.token_ids[:k]
        with LocalEngine(new, tok, max_batch_size=1, stop_on_eos=False) as ref:
            sp_rest = SamplingParams(temperature=0, max_new_tokens=n - k)
            rest = ref.generate([PROMPT + r.token_ids[:k]], sp_rest)
            assert r.token_ids[k:] == rest[0].token_ids
    finally:
        client.close()
        sync.close()
        srv.shutdown()
        eng.close()


def test_check_catches_raw_logprobs_at_temperature_below_one(tok, tmp_path):
    eng, srv, url = _emulated(tok, tmp_path, "vllm", logprobs_mode="raw_logprobs")
    trainer = build_tiny("tiny-moe", seed=0)
    try:
        for temperature, fails in ((0.6, True), (1.0, False)):
            sp = SamplingParams(temperature=temperature, max_new_tokens=12, seed=1)
            check = ServerCheck(VllmEngine, PROMPT, sp, 1e-3, "vLLM")
            sync = _publisher(tmp_path / str(temperature), lambda t: [VllmAdmin(url, t)], [url], trainer,
                              check=check)
            if fails:
                with pytest.raises(WeightPublishError, match="--logprobs-mode processed_logprobs") as e:
                    sync.publish([trainer.state_dict()], 0)
                assert f"server at {url}" in str(e.value) and "after version 0" in str(e.value)
                assert FileSource(sync.files.dir).latest() is None  # never announced to the workers
            else:
                sync.publish([trainer.state_dict()], 0)
                assert sync.gaps[0][url] < 1e-4
                assert sync.metrics()["weights/verify_max_gap"] == sync.gaps[0][url]
                assert sync.metrics() == {}  # taken once
            sync.close()
    finally:
        srv.shutdown()
        eng.close()


def test_check_schedule_first_two_then_every_k():
    check = ServerCheck(VllmEngine, PROMPT, SamplingParams(), 1e-3, "vLLM", every=5)
    due = [v for n, v in enumerate(range(7, 30), start=1) if check.due(n, v)]
    assert due == [7, 8, 10, 15, 20, 25]
    never = ServerCheck(VllmEngine, PROMPT, SamplingParams(), 1e-3, "vLLM", every=0)
    assert [v for n, v in enumerate(range(3, 30), start=1) if never.due(n, v)] == [3, 4]


class _Admin:
    def __init__(self, url, hang=False, fail=False):
        self.url, self.hang, self.fail, self.calls = url, hang, fail, []

    async def pause(self):
        self.calls.append("pause")

    async def load(self, hf_dir, version):
        self.calls.append(("load", version))
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise EngineError("bad weights")

    async def resume(self):
        self.calls.append("resume")


@pytest.mark.parametrize("kind", ["hang", "fail"])
def test_publisher_watchdog_and_resume_always(tmp_path, kind):
    model = build_tiny("tiny-dense", seed=0)
    good, bad = _Admin("http://good:1"), _Admin("http://bad:1", hang=kind == "hang", fail=kind == "fail")
    transport = HttpTransport("http://unused:1")
    sync = ServerPublisher(FilePublisher(tmp_path), [good, bad], transport, model, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(WeightPublishError, match="http://bad:1") as e:
        sync.publish([model.state_dict()], 4)
    assert time.monotonic() - t0 < 5
    assert ("within 0.5s" in str(e.value)) == (kind == "hang")
    assert ("bad weights" in str(e.value)) == (kind == "fail")
    assert good.calls == ["pause", ("load", 4), "resume"] and bad.calls == ["pause", ("load", 4), "resume"]
    # the workers are not told about a version the servers do not run
    assert FileSource(sync.files.dir).latest() is None
    sync.close()


class _AdapterAdmin:
    lora_route_hint = "restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment"

    def __init__(self, url, error=None):
        self.url, self.error, self.calls = url, error, []

    async def load_adapter(self, name, path):
        self.calls.append(("load", name, path))
        if self.error:
            raise EngineError(self.error)

    async def unload_adapter(self, name):
        self.calls.append(("unload", name))


def test_adapter_publication_loads_everywhere_announces_and_unloads_all_but_the_newest_two(tmp_path):
    from saorl.engines.clients.adapters import adapter_name

    a, b = _AdapterAdmin("http://a:1"), _AdapterAdmin("http://b:1")
    transport = HttpTransport("http://unused:1")
    sync = ServerPublisher(FilePublisher(tmp_path), [a, b], transport, build_tiny("tiny-dense", seed=0))
    tensors = {"base_model.model.x.lora_A.weight": torch.zeros(2, 3),
               "base_model.model.x.lora_B.weight": torch.zeros(3, 2)}
    names = [adapter_name(tmp_path / f"v{v:08d}-adapter") for v in range(4)]
    for v in range(4):
        sync.publish([tensors], v, WeightNames.adapter({"r": 2, "lora_alpha": 4}))
        assert FileSource(sync.files.dir).latest() == (v, str(tmp_path / f"v{v:08d}-adapter"))
    assert names[0].startswith("saorl-") and names[0].endswith("-v00000000-adapter") and len(set(names)) == 4
    loads = [("load", names[v], str((tmp_path / f"v{v:08d}-adapter").resolve())) for v in range(4)]
    assert a.calls == b.calls == [*loads[:3], ("unload", names[0]), loads[3], ("unload", names[1])]
    # another run's weights directory: other names on the same server
    assert adapter_name(tmp_path / "other" / "v00000000-adapter") != names[0]
    sync.close()


def test_adapter_publication_to_a_server_without_the_runtime_routes_fails_naming_the_variable(tmp_path):
    bad = _AdapterAdmin("http://bad:1", error='POST http://bad:1/v1/load_lora_adapter failed with HTTP 404: '
                                               '{"detail":"Not Found"}')
    transport = HttpTransport("http://unused:1")
    sync = ServerPublisher(FilePublisher(tmp_path), [bad], transport, build_tiny("tiny-dense", seed=0))
    with pytest.raises(WeightPublishError, match="http://bad:1") as e:
        tensors = {"base_model.model.x.lora_A.weight": torch.zeros(2, 3)}
        sync.publish([tensors], 0, WeightNames.adapter({"r": 2}))
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in str(e.value)
    assert FileSource(sync.files.dir).latest() is None  # never announced
    sync.close()


def test_the_vllm_client_names_the_announced_adapter_and_tags_its_version(tmp_path):
    from saorl.engines.clients.adapters import adapter_name
    from saorl.models.adapter import write_adapter_dir

    path = write_adapter_dir({"base_model.model.x.lora_A.weight": torch.zeros(2, 3)}, {"r": 2},
                             tmp_path / "v00000005-adapter")
    engine = VllmEngine("http://unused:1", model="policy")
    try:
        p = SamplingParams(max_new_tokens=3)
        assert engine._body([1, 2], p, 0)["model"] == "policy"
        engine.update_weights(str(tmp_path / "v00000004.safetensors"), 4)  # full weights: the base name
        assert engine._adapter is None
        engine.update_weights(str(path), 5)
        assert engine._adapter == (5, adapter_name(path))
        assert engine._body([1, 2], p, 5, model=engine._adapter[1])["model"] == adapter_name(path)
    finally:
        engine.close()


def test_emulated_weight_routes_stay_inside_the_weights_dir(tok, tmp_path):
    eng, srv, url = _emulated(tok, tmp_path / "allowed", "sglang")
    (tmp_path / "allowed").mkdir(exist_ok=True)
    try:
        for path in ("/etc", str(tmp_path), "/nonexistent/x"):
            body = {"model_path": path, "weight_version": "9"}
            r = httpx.post(url + "/update_weights_from_disk", json=body)
            assert r.status_code == 403 and "weights directory" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/get_weight_version").json() == {"weight_version": "0"}
    finally:
        srv.shutdown()
        eng.close()


@pytest.mark.parametrize("emulate, route, body", [
    ("sglang", "/update_weights_from_disk", lambda path: {"model_path": path, "weight_version": "9"}),
    ("vllm", "/collective_rpc", lambda path: {"method": "reload_weights", "kwargs": {"weights_path": path}}),
])
def test_emulated_weight_routes_refuse_what_is_not_the_model(tok, tmp_path, emulate, route, body):
    import json

    from saorl.models.hf_format import save_hf_weights

    eng, srv, url = _emulated(tok, tmp_path, emulate)
    try:
        other = build_tiny("tiny-moe", seed=1)
        bigger = save_hf_weights(other, other.state_dict(), tmp_path / "bigger")
        config = json.loads((bigger / "config.json").read_text())  # refused before it is built
        (bigger / "config.json").write_text(json.dumps({**config, "hidden_size": 8192, "vocab_size": 10**6}))
        broken = save_hf_weights(other, other.state_dict(), tmp_path / "broken")
        (broken / "model.safetensors").write_bytes(b"\x00" * 100)
        for path, says in ((bigger, "config.json describes another model"), (broken, "deserializing header")):
            r = httpx.post(url + route, json=body(str(path)))
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert eng.version == 0
    finally:
        srv.shutdown()
        eng.close()


@pytest.mark.vllm
@pytest.mark.gpu
def test_against_a_real_sglang_server():
    pytest.skip("needs a running SGLang 0.5 server on a GPU machine; this CPU test suite drives the "
                "clients against saorl's emulation instead")


def test_sharded_publication_in_buckets_reaches_the_server(tok, tmp_path):
    """``WeightNames.checkpoint`` (the sharded trainer's buckets in checkpoint names): written once,
    loaded by the server, labelled and announced like ``publish``."""
    from saorl.models.hf_format import saved_names, to_checkpoint

    eng, srv, url = _emulated(tok, tmp_path, "vllm", logprobs_mode="processed_logprobs")
    new = build_tiny("tiny-moe", seed=1)
    check = ServerCheck(VllmEngine, PROMPT, SamplingParams(temperature=0.7, top_k=20, seed=2), 1e-4, "vLLM")
    sync = _publisher(tmp_path, lambda t: [VllmAdmin(url, t)], [url], build_tiny("tiny-moe", seed=0),
                      check=check)
    client = VllmEngine(url)
    try:
        state = new.state_dict()
        names = saved_names(new)
        buckets = (to_checkpoint(new, {n: state[n] for n in names[i:i + 10]})
                   for i in range(0, len(names), 10))
        sync.publish(buckets, 1, WeightNames.checkpoint(new.config))
        assert sync.gaps[1][url] < 1e-4  # scored by the policy read back from the directory
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}
        assert FileSource(sync.files.dir).latest() == (1, str(tmp_path / "weights" / "hf" / "v00000001"))
        assert len(list((tmp_path / "weights" / "hf" / "v00000001").glob("model-*.safetensors"))) >= 2
        sp = SamplingParams(temperature=0, max_new_tokens=6)
        got = client.generate([PROMPT], sp)[0]
        with LocalEngine(new, tok, max_batch_size=1, stop_on_eos=False) as ref:
            assert got.token_ids == ref.generate([PROMPT], sp)[0].token_ids and got.versions == [1] * 6
    finally:
        client.close()
        sync.close()
        srv.shutdown()
        eng.close()


def test_check_server_command_against_the_emulation(tok, tmp_path, capsys):
    """``saorl check-server --reload`` end to end on loopback (the real server: tests/vllm): the
    policy as given, a perturbed copy and the policy again, each checked; a server that runs
    another model fails the first check with exit 3."""
    from saorl.cli import main

    eng, srv, url = _emulated(tok, tmp_path, "vllm", logprobs_mode="processed_logprobs")
    try:
        argv = ["check-server", "--url", url, "model.policy=tiny-moe", "rollout.temperature=0.7",
                "--reload", "--weights-dir", str(tmp_path / "ck")]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.count(": ok") == 3 and "a perturbed copy, reloaded in place" in out, out
        assert main([*argv[:-3], "seed=1"]) == 3  # the trainer's policy is another one than the server's
        assert "FAILED" in capsys.readouterr().out
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.yaml").write_text("{}\n")
        assert main([*argv[:-1], str(tmp_path / "run")]) == 2  # never over a run's weights
    finally:
        srv.shutdown()
        eng.close()


class _FakeServer:
    """A server that answers the check's request with the trainer's own tokens and log-probs, off
    by ``offsets[i]`` nats on the i-th request (a round-off outlier, or a wrong model)."""

    def __init__(self, model, offsets, ids=None):
        self.model, self.offsets, self.ids, self.requests = model, list(offsets), ids, []

    def __call__(self, url):
        return self

    def generate(self, prompts, sp):
        from saorl.engines.base import GenerationResult

        self.requests.append(sp.seed)
        ids = self.ids or [9, 10, 11, 12]
        if self.ids:  # another model's token ids: its own log-probs
            return [GenerationResult(ids, [-1.0] * len(ids), "length", [0] * len(ids))]
        x = torch.tensor([prompts[0] + ids])
        with torch.no_grad():
            mine = token_logprobs(self.model, x, torch.ones_like(x), temperature=sp.temperature)
        mine = mine[0, len(prompts[0]):]
        off = self.offsets[min(len(self.requests), len(self.offsets)) - 1]
        return [GenerationResult(ids, [float(v) + off for v in mine], "length", [0] * len(ids))]

    def close(self):
        pass


def test_check_fails_a_server_only_on_two_bad_requests_in_a_row_and_names_another_vocabulary():
    model = build_tiny("tiny-dense", seed=0)
    sp = SamplingParams(temperature=0.8, max_new_tokens=4, seed=7)
    outlier = _FakeServer(model, [0.5, 0.0])  # one bad request, then a good one: passes
    assert ServerCheck(outlier, PROMPT, sp, 1e-3, "vLLM").check(model, ["http://s:1"], 3)["http://s:1"] < 1e-5
    assert outlier.requests == [7, 8]  # the second request with the next seed
    wrong = _FakeServer(model, [0.5, 0.5])
    bad = r"after version 3 was put on it, returns log-probs up to 0\.5 "
    with pytest.raises(WeightPublishError, match=bad):
        ServerCheck(wrong, PROMPT, sp, 1e-3, "vLLM").check(model, ["http://s:1"], 3)
    vocab = model.get_output_embeddings().weight.shape[0]
    other = _FakeServer(model, [0.0], ids=[vocab + 3])
    with pytest.raises(WeightPublishError, match=rf"token id {vocab + 3} .* vocabulary of {vocab}: it runs"):
        ServerCheck(other, PROMPT, sp, 1e-3, "vLLM").check(model, ["http://s:1"], 0)


class _EdgeServer:
    """A server exact but for its top-p sums: at the position where the trainer's nucleus ends
    exactly on a token (its mass before = ``top_p``), it keeps that token, as vLLM's ascending sum
    can."""

    def __init__(self, model, ids, top_p):
        self.model, self.ids, self.top_p = model, ids, top_p

    def __call__(self, url):
        return self

    def generate(self, prompts, sp):
        from saorl.engines.base import GenerationResult

        x = torch.tensor([prompts[0] + self.ids])
        with torch.no_grad():
            served = token_logprobs(self.model, x, torch.ones_like(x), temperature=sp.temperature,
                                    top_p=self.top_p)[0, len(prompts[0]):]
        return [GenerationResult(self.ids, served.tolist(), "length", [0] * len(self.ids))]

    def close(self):
        pass


def test_check_leaves_out_a_position_whose_top_p_edge_round_off_decides():
    """Measured on a real vLLM (7 positions in 78,923): the kept set of a flat distribution can
    end exactly on ``top_p``, where vLLM keeps one token more than the trainer; every log-prob of
    that position is then off by that token's share (~7e-4), which is no wrong weight."""
    model, ids = build_tiny("tiny-dense", seed=0), list(range(9, 25))  # 16 tokens: 2 may be left out
    x = torch.tensor([PROMPT + ids])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=x).logits[0, len(PROMPT) - 1].float(), -1)
    ordered = probs.sort(descending=True)
    before = torch.cumsum(ordered.values, 0) - ordered.values
    assert int((ordered.indices == ids[0]).nonzero()) < len(probs) - 8
    top_p = float(before[-8])  # the trainer drops the 8th-last token there, the server keeps it
    server = _EdgeServer(model, ids, top_p + 1e-7)
    sp = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=16, seed=0)
    check = ServerCheck(server, PROMPT, sp, 1e-5, "vLLM")
    gap, _, tokens, outside = check.measure(model, "http://s:1")
    assert (tokens, outside) == (16, 1) and gap < 1e-6
    served = server.generate([PROMPT], sp)[0].logprobs[0]
    with torch.no_grad():
        mine = token_logprobs(model, x, torch.ones_like(x), top_p=top_p)[0, len(PROMPT)]
    assert abs(served - float(mine)) > 1e-5  # what the check would have called a wrong model
    assert check.check(model, ["http://s:1"], 2)["http://s:1"] < 1e-6
