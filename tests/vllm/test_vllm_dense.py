"""A real vLLM 0.32.0 CPU server with a dense policy whose output head is tied to its embeddings
(as every Qwen3 up to 4B): the log-prob contract DIS needs, publication of changed weights
verified on the server, and a stale output head caught by the check."""

import httpx
import pytest
import torch

from saorl.engines import SamplingParams
from saorl.engines.clients.transport import HttpTransport
from saorl.engines.clients.vllm_client import VllmAdmin, VllmEngine
from saorl.models import hf_format
from saorl.models.tiny import build_tiny
from saorl.runtime.weights.files import FilePublisher, FileSource, WeightNames
from saorl.runtime.weights.servers import ServerCheck, ServerPublisher, WeightPublishError

PROMPT = list(range(5, 40))
TOL = 1e-5  # float32 server and trainer: measured gaps are below 1e-6


def _check(sampling: SamplingParams, every: int = 1) -> ServerCheck:
    return ServerCheck(lambda url: VllmEngine(url, model="policy"), PROMPT, sampling, TOL, "vLLM",
                       every=every)


def _sync(tmp_path, url, model, check) -> ServerPublisher:
    transport = HttpTransport([url], timeout_s=120)
    files = FilePublisher(tmp_path / "weights")
    return ServerPublisher(files, [VllmAdmin(url, transport)], transport, model, check=check)


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_processed_logprobs_equal_the_trainers(dense, sampling):
    """The server's log-prob of each sampled token is the trainer's under the same temperature and
    truncation (``--logprobs-mode processed_logprobs``), to float32 round-off, for several seeds."""
    model = build_tiny("tiny-dense", seed=0)  # what the server was started with
    gaps = []
    for seed in range(3):
        check = _check(SamplingParams(**sampling, max_new_tokens=32, seed=seed))
        gap, raw_gap, n, outside = check.measure(model, dense.url)
        assert n == 32 and outside == 0
        gaps.append(gap)
        if sampling != dict(temperature=1.0):  # the raw distribution is measurably another one
            assert raw_gap > 100 * TOL
    print(f"\nRESULT processed {sampling}: max gaps {[f'{g:.2e}' for g in gaps]}")
    assert max(gaps) < TOL


def test_changed_weights_are_verified_on_the_server_and_a_stale_head_is_caught(dense, tmp_path, monkeypatch):
    start = build_tiny("tiny-dense", seed=0)
    sync = _sync(tmp_path, dense.url, start, _check(SamplingParams(temperature=0.7, top_k=20, seed=3)))
    try:
        sync.publish([start.state_dict()], 0)
        for version, seed in ((1, 1), (2, 2)):  # new weights, the output head (tied) included
            model = build_tiny("tiny-dense", seed=seed)
            sync.model = model
            sync.publish([model.state_dict()], version)
            assert sync.gaps[version][dense.url] < TOL
            assert httpx.get(dense.url + "/weight_info").json() == {"weight_version": str(version)}
        assert FileSource(sync.files.dir).latest()[0] == 2
        print(f"\nRESULT tied dense: gaps per version {sync.gaps}")

        # the writer of before: no lm_head.weight, as save_pretrained writes a tied model
        monkeypatch.setattr(hf_format, "served_names", hf_format.saved_names)
        stale = build_tiny("tiny-dense", seed=3)
        sync.model = stale
        with pytest.raises(WeightPublishError) as e:
            sync.publish([stale.state_dict()], 3)
        msg = str(e.value)
        print(f"\nRESULT stale head: {msg}")
        assert f"server at {dense.url}" in msg and "after version 3" in msg and "reload" in msg
        assert FileSource(sync.files.dir).latest()[0] == 2  # the workers were never told of version 3
        gap = float(msg.split("up to ")[1].split()[0])
        assert gap > 1e-2
    finally:
        sync.close()


def test_describe_names_a_cpu_server_without_the_plugin(dense):
    transport = HttpTransport([dense.url], timeout_s=60)
    try:
        info = transport.run(VllmAdmin(dense.url, transport).describe())
    finally:
        transport.close()
    assert (info.version, info.device, info.dtype, info.plugin) == ("0.32.0", "cpu", "float32", False)
    assert info.reload_method == "reload_weights"


def test_logprobs_of_a_request_are_those_of_the_published_version(dense, tmp_path):
    """After a publication, a plain rollout request (the client the workers use) is scored by the
    new weights: tokens and log-probs equal the trainer's for the same tokens."""
    from saorl.models.logprobs import token_logprobs

    model = build_tiny("tiny-dense", seed=7)
    sync = _sync(tmp_path, dense.url, model, None)
    client = VllmEngine(dense.url, model="policy")
    try:
        sync.publish([model.state_dict()], 11)
        res = client.generate([PROMPT], SamplingParams(temperature=1.0, max_new_tokens=24, seed=5))[0]
        assert res.versions == [11] * len(res.token_ids)
        ids = torch.tensor([PROMPT + res.token_ids])
        mine = token_logprobs(model, ids, torch.ones_like(ids))[0, len(PROMPT):]
        assert (torch.tensor(res.logprobs) - mine).abs().max() < TOL
    finally:
        client.close()
        sync.close()


def test_check_server_command_passes_a_good_server_and_catches_a_stale_head(dense, tmp_path, capsys,
                                                                             monkeypatch):
    from saorl.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["check-server", "--url", dense.url, "model.policy=tiny-dense", "rollout.engine.model=policy",
            "rollout.temperature=0.7", "rollout.top_k=20", "--reload"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.32.0 on cpu, dtype float32, processed_logprobs, without saorl's plugin" in out
    assert out.count(": ok") == 3, out  # as given, a perturbed copy reloaded, the policy reloaded back
    monkeypatch.setattr(hf_format, "served_names", hf_format.saved_names)  # the writer of before
    assert main(argv) == 3
    out = capsys.readouterr().out
    assert "a perturbed copy, reloaded in place" in out and "FAILED" in out and "reload" in out
    print(f"\nRESULT check-server on a stale head:\n{out}")
    monkeypatch.undo()
    assert main(argv) == 0  # the server is left with the policy


def test_sharded_publication_is_checked_from_the_published_directory(dense, tmp_path):
    """``WeightNames.checkpoint`` (the sharded trainer's buckets): the directory carries the tied head,
    the server loads it, and the check scores the request with the policy read back from it."""
    model = build_tiny("tiny-dense", seed=9)
    check = _check(SamplingParams(temperature=0.7, top_k=20, seed=4))
    sync = _sync(tmp_path, dense.url, build_tiny("tiny-dense", seed=0), check)
    try:
        state, names = model.state_dict(), hf_format.served_names(model)
        buckets = (hf_format.to_checkpoint(model, {n: state[n] for n in names[i:i + 8]})
                   for i in range(0, len(names), 8))
        sync.publish(buckets, 21, WeightNames.checkpoint(model.config))
        assert sync.gaps[21][dense.url] < TOL and FileSource(sync.files.dir).latest()[0] == 21
        assert sync.metrics() == {"weights/verify_max_gap": sync.gaps[21][dense.url],
                                  "weights/verified_version": 21}
    finally:
        sync.close()
