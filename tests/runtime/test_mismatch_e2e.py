"""The rollout-side mismatch knobs, end to end: the engine differs from the trainer only when asked,
and the staleness-0 mismatch metric sees it (issue: a miniature where DIS has something to do)."""

from __future__ import annotations

import pytest
from runtime_helpers import SYNC_MISMATCH_BASE as BASE

from saorl.config import load_config
from saorl.data.jsonl import read_jsonl
from saorl.training import train


def _staleness0_kl(tmp_path, *knobs: str) -> list[float]:
    cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path}", *knobs])
    run_dir, _ = train(cfg, tmp_path / "run")
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) > 0]
    assert len(rows) == 2
    return [r["mismatch/kl_s0"] for r in rows]  # sync: every token has staleness 0


@pytest.mark.slow
def test_engine_only_knobs_create_a_staleness0_mismatch_and_none_without(tmp_path):
    off = _staleness0_kl(tmp_path / "off")
    assert max(off) < 1e-5
    on = _staleness0_kl(tmp_path / "on", "rollout.engine.dtype=bfloat16", "rollout.engine.moe_top_k=3",
                        "algo.behaviour=trainer")
    # a random-init policy is nearly uniform, so the mismatch is small — but far above the off case
    assert min(on) > 1e-5 and min(on) > 10 * max(off)


@pytest.mark.slow
def test_routing_replay_brings_the_routing_mismatch_back_to_zero(tmp_path):
    perturb = ["rollout.engine.moe_top_k=3", "rollout.engine.router_noise=0.5"]
    perturbed = _staleness0_kl(tmp_path / "perturbed", *perturb)
    replayed = _staleness0_kl(tmp_path / "replayed", *perturb, "algo.routing_replay=true")
    assert min(perturbed) > 1e-5 and max(replayed) < 1e-6
