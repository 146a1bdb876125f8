"""SAO with ``rollout.engine: vllm | sglang`` end to end: a rollout worker process drives an
emulated server over loopback, the trainer publishes every version to it in place, and the
trajectories carry per-token versions that are checked against the published weights."""

import pytest
import torch
from runtime_helpers import BASE, KeepTrajectories, turns
from safetensors.torch import load_file

from saorl.config import load_config
from saorl.engines.local import LocalEngine
from saorl.engines.serve.server import serve_in_thread
from saorl.models.logprobs import token_logprobs
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.weights.files import FilePublisher
from saorl.training import train

pytestmark = pytest.mark.slow


def _run(tmp_path, monkeypatch, engine: str):
    monkeypatch.setattr(FilePublisher, "_prune", lambda self: None)  # keep every version to check
    tok = load_tokenizer()
    # the server starts with other weights: only the publisher's version 0 makes it the trainer's policy
    eng = LocalEngine(build_tiny("tiny-moe", seed=5), tok, max_batch_size=8)
    extra = {"logprobs_mode": "processed_logprobs"} if engine == "vllm" else {}
    srv, url = serve_in_thread(eng, tokenizer=tok, weights_dir=tmp_path, emulate=engine, **extra)
    keep = KeepTrajectories()
    try:
        # multi-turn episodes (synthetic: 2-5 turns), so updates land between turns as well
        cfg = load_config(None, [*BASE, "trainer.steps=8", f"rollout.engine={engine}",
                                 f"rollout.engine.urls=[{url}]", "env.type=synthetic",
                                 "env.options.mean_turns=3", "env.options.cv=0.5", "env.options.max_turns=5",
                                 "rollout.max_total_tokens=120"])
        run_dir, metrics = train(cfg, tmp_path / "run", observer=keep)
    finally:
        srv.shutdown()
        eng.close()
    assert metrics["policy/version"] == 8 and len(keep.trajectories) == 32
    scored: dict[int, torch.nn.Module] = {}

    def logprobs_at(version: int, ids: list[int]) -> list[float]:
        if version not in scored:
            model = build_tiny("tiny-moe", seed=0)
            state = load_file(str(run_dir / "weights" / f"v{version:08d}.safetensors"))
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied to the embedding
            scored[version] = model.eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            return token_logprobs(scored[version], x, torch.ones_like(x))[0].tolist()

    exact, spanning = 0, 0
    multi_version = []
    for traj in keep.trajectories:
        runs = turns(traj)
        versions = [v for v, _ in runs]
        assert versions == sorted(versions)  # never back in time
        if len(set(versions)) > 1:
            multi_version.append(traj)
        for v, pos in runs:
            mine = logprobs_at(v, traj.token_ids)
            if all(abs(traj.rollout_logprobs[t] - mine[t]) < 2e-4 for t in pos):
                exact += 1
                continue
            spanning += 1
            # a turn that spanned an update is tagged with a version no newer than the one that
            # sampled its first token (a fresh prefill: its log-prob is exactly some version's)
            first = pos[0]
            assert any(abs(traj.rollout_logprobs[first] - logprobs_at(u, traj.token_ids)[first]) < 2e-4
                       for u in range(v, metrics["policy/version"] + 1)), (v, first)
    print(f"\nRESULT {engine}: {len(keep.trajectories)} trajectories, {len(multi_version)} span versions, "
          f"{exact} exact turns, {spanning} spanning")
    return keep.trajectories, multi_version, exact, spanning


def test_sao_with_sglang_has_exact_per_token_versions(tmp_path, monkeypatch):
    _, multi, exact, spanning = _run(tmp_path, monkeypatch, "sglang")
    # abort mode: every chunk is sampled with its version's weights from a fresh prefill, so every
    # turn's log-probs are those of the version it is tagged with
    assert spanning == 0 and exact > 32
    assert multi, "no episode spanned a weight update; nothing was checked across one"


def test_sao_with_vllm_tags_each_turn_with_its_version(tmp_path, monkeypatch):
    _, multi, exact, spanning = _run(tmp_path, monkeypatch, "vllm")
    # a turn that did not span an update is exact; one that did is tagged with the older version
    # and sampled partly by the newer one (how many span depends on timing)
    assert exact >= 0.5 * (exact + spanning) and exact > 32
    assert multi, "no episode spanned a weight update; nothing was checked across one"
