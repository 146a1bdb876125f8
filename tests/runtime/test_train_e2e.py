"""SAO end to end: rollout workers in their own processes feed the trainer asynchronously."""

import json
import math
import os
import stat

import pytest
import torch
from runtime_helpers import BASE, read_jsonl
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from saorl.config import load_config
from saorl.models.tiny import build_tiny
from saorl.runtime.recorder import REQUIRED_KEYS
from saorl.training import train

pytestmark = pytest.mark.slow


def test_async_sao_trains_with_stale_multi_version_batches(tmp_path):
    cfg = load_config(None, [*BASE, "trainer.steps=12", "run.checkpoint_every=6", "run.eval_every=5",
                             "run.samples_every=6"])
    run_dir, _ = train(cfg, tmp_path / "run")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(0, 13))
    start, rows = rows[0], rows[1:]  # the step-0 evaluation is a row of its own, in every sink
    assert start["policy/version"] == 0 and "eval/accuracy" in start and "reward/mean" not in start
    for r in rows:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert all(v is None or math.isfinite(v) for v in r.values() if isinstance(v, (int, float))), r
    assert rows[-1]["policy/version"] == 12
    # asynchrony is real: trajectories were sampled by older policies, and by many of them
    # (how many versions share one batch depends on timing, so that is not asserted)
    assert max(r["rollout/staleness_max"] for r in rows) > 0
    trained = read_jsonl(run_dir / "trained.jsonl")
    versions = {v for row in trained for vs in row["versions"] for v in vs}
    assert len(versions) > 3, versions
    rids = [rid for row in trained for rid in row["rids"]]
    assert len(rids) == len(set(rids)) == 48  # each trajectory trained on exactly once
    # the weights changed, the checkpoint and the exported policy are there
    init = build_tiny("tiny-moe", seed=0).state_dict()
    ckpt = load_file(str(run_dir / "checkpoints" / "step-00000012" / "policy.safetensors"))
    changed = [k for k in init if not torch.equal(init[k], ckpt[k])]
    assert len(changed) > len(init) // 2
    assert (run_dir / "final" / "policy" / "config.json").exists()
    assert (run_dir / "final" / "critic" / "critic.json").exists()
    tb = EventAccumulator(str(run_dir / "tb"), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    assert [e.step for e in tb.Scalars("eval/accuracy")] == [0, 5, 10, 12]  # and the last step, always
    ratios = tb.Histograms("policy/ratio_hist")  # the DIS ratio histogram, every step
    assert [h.step for h in ratios] == list(range(1, 13))
    assert all(h.histogram_value.num == sum(r["policy/ratio_hist"]) for h, r in zip(ratios, rows))
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 5, 10, 12] and all("eval/accuracy" in e for e in evals)
    assert "eval/accuracy" in rows[-1]  # the last step's row: the exported policy's accuracy
    assert (run_dir / "samples" / "step-00000006.txt").read_text().count("[act 1]") >= 1
    assert (run_dir / "config.yaml").exists() and (run_dir / "algo_resolved.yaml").exists()
    assert (run_dir / "run.png").read_bytes()[:4] == b"\x89PNG"  # the run's picture (saorl plot)
    umask = os.umask(0o022)
    os.umask(umask)
    for p in [run_dir / "final" / "policy", *(run_dir / "final" / "policy").iterdir()]:  # as a plain
        assert stat.S_IMODE(p.stat().st_mode) & 0o444 == 0o444 & ~umask, p               # mkdir leaves it
    stab = json.loads((run_dir / "stability.json").read_text())  # the run's continuous signals
    kl = [r["mismatch/kl"] for r in rows]
    assert stab["steps"] == 12 and stab["drift bursts"] == sum(v > stab["drift_kl"] for v in kl) / 12
    assert math.isclose(stab["reward AUC"], sum(r["reward/mean"] for r in rows) / 12)
    assert stab["update rel"] > 0 and stab["acc@12"] == evals[-1]["eval/accuracy"]


def test_sync_grpo_has_a_barrier_and_whole_groups(tmp_path):
    cfg = load_config(None, [*BASE, "algo.name=grpo", "algo.group_size=2", "trainer.steps=4"])
    run_dir, _ = train(cfg, tmp_path / "run")
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]  # after the step-0 evaluation
    assert len(rows) == 4
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    for row in read_jsonl(run_dir / "trained.jsonl"):
        # every trajectory of step k was sampled entirely by version k-1: the barrier
        assert all(vs == [row["step"] - 1] for vs in row["versions"]), row
        tids = row["task_ids"]
        assert len(tids) == 4 and tids[0] == tids[1] and tids[2] == tids[3] and tids[0] != tids[2]


def test_a_failing_backend_shutdown_still_closes_the_journal_and_the_recorder(tmp_path, monkeypatch):
    """A sharded rank leaves with os._exit (no atexit tracker flush), so the run itself must close
    its journal and trackers even when shutting the rollout backend down fails."""
    from saorl.runtime.backends.inprocess import InProcessBackend
    from saorl.runtime.journal import Journal
    from saorl.runtime.recorder import RunRecorder

    closed = []
    for cls, name in ((Journal, "journal"), (RunRecorder, "recorder")):
        def close(self, _orig=cls.close, _name=name):
            closed.append(_name)
            return _orig(self)
        monkeypatch.setattr(cls, "close", close)
    real_shutdown = InProcessBackend.shutdown

    def failing_shutdown(self):
        real_shutdown(self)
        raise RuntimeError("backend shutdown failed")

    monkeypatch.setattr(InProcessBackend, "shutdown", failing_shutdown)
    cfg = load_config(None, [*BASE, "runtime.backend=inprocess", "trainer.steps=1"])
    with pytest.raises(RuntimeError, match="backend shutdown failed"):
        train(cfg, tmp_path / "run")
    assert closed == ["journal", "recorder"]
