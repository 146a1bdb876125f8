"""Nothing lost: kill -9 of the whole run, a killed rollout worker, Ctrl-C."""

import json
import os
import signal

import pytest
from runtime_helpers import read_jsonl, rollout_worker_pids, start_train, wait_for_steps

from saorl.cli import main
from saorl.runtime.checkpoint import latest_checkpoint
from saorl.runtime.journal import Journal, RangeSet

pytestmark = pytest.mark.slow


def _pending_rids(ckpt) -> set[int]:
    return {json.loads(line)["rid"] for line in (ckpt / "pending.jsonl").read_text().splitlines()}


def test_resume_after_kill_9_trains_every_journaled_trajectory_exactly_once(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, "trainer.steps=1000", "run.checkpoint_every=3", log=log)
    try:
        wait_for_steps(proc, run_dir, 5, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # trainer and workers, mid-flight, no clean-up at all
        proc.wait()
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    c = manifest["step"]
    assert c >= 3
    before = read_jsonl(run_dir / "trained.jsonl")
    # what resume must train: the checkpoint's pending trajectories + everything journaled after it
    journaled_after = {rid for rid, _ in Journal(run_dir / "journal").read_from(manifest["journal_segment"])}
    owed = _pending_rids(ckpt) | (journaled_after - set(RangeSet.from_ranges(manifest["finished"])))
    assert owed, "the kill should leave journaled, untrained trajectories behind"

    assert main(["train", "--resume", str(run_dir), f"trainer.steps={c + 8}"]) == 0
    after = read_jsonl(run_dir / "trained.jsonl")[len(before):]
    assert [r["step"] for r in after] == list(range(c + 1, c + 9))
    # effective history: steps up to the checkpoint, then the resumed steps (later ones were rolled back)
    effective = [r for r in before if r["step"] <= c] + after
    rids = [rid for r in effective for rid in r["rids"]]
    tasks = [t for r in effective for t in r["task_ids"]]
    assert len(rids) == len(set(rids)), "a trajectory was trained twice"
    assert len(tasks) == len(set(tasks)), "a task was repeated"
    resumed = {rid for r in after for rid in r["rids"]}
    assert owed <= resumed, f"journaled trajectories never trained: {sorted(owed - resumed)}"
    # nothing skipped: every finished rollout is either trained or pending in the final checkpoint
    final = latest_checkpoint(run_dir / "checkpoints")
    fm = json.loads((final / "manifest.json").read_text())
    finished = set(RangeSet.from_ranges(fm["finished"]))
    assert set(rids) <= finished
    assert finished - set(rids) <= _pending_rids(final)


def test_killed_rollout_worker_is_restarted_and_its_episodes_requeued(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, "trainer.steps=8", log=log)
    try:
        wait_for_steps(proc, run_dir, 2, log)
        workers = rollout_worker_pids(proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(9))  # the step-0 evaluation, then 8 steps
    assert rows[-1]["rollout/worker_restarts"] == 1
    assert "restarted" in log.read_text()
    rids = [rid for r in read_jsonl(run_dir / "trained.jsonl") for rid in r["rids"]]
    assert len(rids) == len(set(rids))


def test_ctrl_c_checkpoints_and_exits_cleanly(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, "trainer.steps=1000", log=log)
    try:
        wait_for_steps(proc, run_dir, 2, log)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == steps[-1]
    assert (run_dir / "final" / "policy" / "config.json").exists()
    assert "stopping" in log.read_text()
    assert not rollout_worker_pids(proc.pid)
