"""A real vLLM 0.32.0 CPU server with a Qwen3-MoE policy. vLLM's CPU build packs the expert weights
at load and its in-place reload does not pack them again: with saorl's plugin
(``--worker-extension-cls saorl_vllm.WeightReload``) every published version is exact on the
server; without it the reload scrambles the experts, and a run refuses such a server at start-up.
The server without the plugin also runs vLLM's default raw log-probs, which the start-up check and
the publication check both name."""

import pytest

from saorl.config import load_config
from saorl.engines import SamplingParams
from saorl.engines.clients.transport import HttpTransport
from saorl.engines.clients.vllm_client import VllmAdmin, VllmEngine
from saorl.errors import StartupError
from saorl.models.tiny import build_tiny
from saorl.runtime.weights.files import FilePublisher, FileSource
from saorl.runtime.weights.servers import ServerCheck, ServerPublisher, WeightPublishError
from saorl.stages.preflight import check_servers

PROMPT = list(range(5, 40))
TOL = 1e-5


@pytest.fixture(scope="module")
def with_plugin(start_server):
    return start_server("moe", plugin=True)


@pytest.fixture(scope="module")
def plain_raw(start_server):
    return start_server("moe", logprobs_mode="raw_logprobs")


def _sync(tmp_path, url, model, sampling) -> ServerPublisher:
    transport = HttpTransport([url], timeout_s=120)
    check = ServerCheck(lambda u: VllmEngine(u, model="policy"), PROMPT, sampling, TOL, "vLLM", every=1)
    files = FilePublisher(tmp_path / "weights")
    return ServerPublisher(files, [VllmAdmin(url, transport)], transport, model, check=check)


def _config(url, **over):
    return load_config(None, ["model.policy=tiny-moe", "rollout.engine=vllm",
                              f"rollout.engine.urls=[{url}]", *(f"{k}={v}" for k, v in over.items())])


def test_with_the_plugin_every_published_version_is_exact_on_the_server(with_plugin, tmp_path):
    check_servers(_config(with_plugin.url, **{"rollout.temperature": 0.7}))  # accepted at start-up
    sync = _sync(tmp_path, with_plugin.url, build_tiny("tiny-moe", seed=0),
                 SamplingParams(temperature=0.7, top_k=20, max_new_tokens=32, seed=1))
    try:
        for version, seed in ((0, 0), (1, 1), (2, 2), (3, 0)):  # the same weights again, last
            model = build_tiny("tiny-moe", seed=seed)
            sync.model = model
            sync.publish([model.state_dict()], version)
            assert sync.gaps[version][with_plugin.url] < TOL
        assert sync.admins[0].info.plugin and sync.admins[0].info.reload_method == "saorl_reload_weights"
        print(f"\nRESULT moe with plugin: gaps per version {sync.gaps}")
    finally:
        sync.close()


def test_a_raw_logprobs_server_is_refused_at_start_and_caught_by_the_check(plain_raw, tmp_path):
    sampled = {"model.policy": "tiny-dense", "rollout.temperature": 0.7, "rollout.top_k": 20}
    with pytest.raises(StartupError, match="--logprobs-mode processed_logprobs"):
        check_servers(_config(plain_raw.url, **sampled))
    # the same server's log-probs, checked directly (no reload: the weights it started with)
    check = ServerCheck(lambda u: VllmEngine(u, model="policy"), PROMPT,
                        SamplingParams(temperature=0.7, top_k=20, max_new_tokens=32, seed=2), TOL, "vLLM")
    with pytest.raises(WeightPublishError, match=r"untempered, untruncated.*--logprobs-mode processed"):
        check.check(build_tiny("tiny-moe", seed=0), [plain_raw.url], 0)


def test_without_the_plugin_a_cpu_server_is_refused_at_start_and_its_reload_is_caught(plain_raw, tmp_path):
    with pytest.raises(StartupError) as e:
        check_servers(_config(plain_raw.url))
    msg = str(e.value)
    assert "Mixture-of-Experts" in msg and "--worker-extension-cls saorl_vllm.WeightReload" in msg
    assert plain_raw.url in msg
    # dense policies are fine on it at temperature 1 (raw and processed log-probs are the same)
    check_servers(_config(plain_raw.url, **{"model.policy": "tiny-dense"}))

    # why: reloading even the weights the server started with scrambles the packed experts
    sync = _sync(tmp_path, plain_raw.url, build_tiny("tiny-moe", seed=0),
                 SamplingParams(temperature=1.0, max_new_tokens=32, seed=1))
    try:
        with pytest.raises(WeightPublishError, match="after version 0") as e:
            sync.publish([sync.model.state_dict()], 0)
        print(f"\nRESULT moe without plugin, same weights reloaded: {str(e.value)[:200]}")
        assert FileSource(sync.files.dir).latest() is None
    finally:
        sync.close()


def test_saorl_train_refuses_a_raw_server_in_seconds_and_leaves_nothing(plain_raw, tmp_path, capsys):
    import time

    from saorl.cli import main

    t0 = time.monotonic()
    code = main(["train", "model.policy=tiny-dense", "rollout.engine=vllm",
                 f"rollout.engine.urls=[{plain_raw.url}]", "rollout.temperature=0.7",
                 f"run.out_dir={tmp_path}", "--run-dir", str(tmp_path / "run")])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    print(f"\nRESULT raw server refused by saorl train in {took:.1f}s: {err.strip()}")
    assert code == 2 and "--logprobs-mode processed_logprobs" in err and not (tmp_path / "run").exists()
    assert took < 60  # before the SFT warm start (minutes)
