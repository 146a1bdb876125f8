"""Routing replay with a remote engine, end to end: the server is the engine, so the routing
mismatch is the server's own (``--moe-top-k``); its routes travel back over
loopback HTTP (SGLang's ``meta_info.routed_experts``, vLLM's ``choices[].routed_experts``, saorl
serve's ``return_routed_experts``) and
the trainer replays them, which takes the staleness-0 mismatch back to round-off."""

from __future__ import annotations

import pytest
from runtime_helpers import SYNC_MISMATCH_BASE as BASE

from saorl.config import load_config
from saorl.data.jsonl import read_jsonl
from saorl.engines.local import LocalEngine
from saorl.engines.serve.server import serve_in_thread
from saorl.models.routing import perturb_routing
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.training import train

pytestmark = pytest.mark.slow


def _staleness0_kl(tmp_path, engine: str, *knobs: str) -> list[float]:
    """``mismatch/kl_s0`` of each step of a short sync run against an emulated ``engine`` server
    whose engine routes every token to 3 experts instead of 2. (Not router noise: each turn of an
    episode is a new request that re-prefills the context with fresh noise, so no single set of
    routes reproduces every turn; docs/method.md.)"""
    model = build_tiny("tiny-moe", seed=5)  # the first publication replaces these weights
    perturb_routing(model, top_k=3)
    eng = LocalEngine(model, load_tokenizer(), max_batch_size=4, record_routes=True)
    emulate = None if engine == "http" else engine
    extra = {"logprobs_mode": "processed_logprobs"} if engine == "vllm" else {}
    srv, url = serve_in_thread(eng, tokenizer=load_tokenizer(), weights_dir=tmp_path, emulate=emulate,
                               **extra)
    try:
        cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path}", f"rollout.engine={engine}",
                                 f"rollout.engine.urls=[{url}]", *knobs])
        run_dir, _ = train(cfg, tmp_path / "run")
    finally:
        srv.shutdown()
        eng.close()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) > 0]
    assert len(rows) == 2
    return [r["mismatch/kl_s0"] for r in rows]  # sync: every token has staleness 0


@pytest.mark.parametrize("engine", ["sglang", "http", "vllm"])
def test_replaying_a_servers_routes_brings_the_routing_mismatch_back_to_zero(tmp_path, engine):
    # the server routes on purpose unlike the trainer: without replay, its log-probs are another
    # distribution's (0.04 nats per token at most), which the server check would stop at start
    checked = [] if engine == "http" else ["rollout.engine.verify_tol=0.5"]  # saorl serve: no check
    perturbed = _staleness0_kl(tmp_path / "perturbed", engine, *checked)
    replayed = _staleness0_kl(tmp_path / "replayed", engine, "algo.routing_replay=true")
    print(f"\nRESULT {engine}: kl_s0 without replay {perturbed}, with replay {replayed}")
    assert min(perturbed) > 1e-5 and max(replayed) < 1e-6
