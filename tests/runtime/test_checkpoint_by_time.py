"""A run keeps what it learned: a checkpoint by time (``run.checkpoint_every_s``) as well as by
steps, so a run killed long before its ``run.checkpoint_every``-th step resumes from one and
loses nothing journalled; and one at the last step of a run stopped by its budget."""

import json
import os
import signal
import time

import pytest
from runtime_helpers import (
    BASE,
    audit_exactly_once,
    journalled_rids,
    read_jsonl,
    resume_train,
    start_train,
    step_rows,
    wait_for_steps,
    wait_until_gone,
)

from saorl.cli import main
from saorl.runtime.checkpoint import latest_checkpoint
from saorl.runtime.recorder import effective_rows

pytestmark = pytest.mark.slow


def _wait_for_checkpoint(proc, run_dir, log, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while (ckpt := latest_checkpoint(run_dir / "checkpoints")) is None:
        assert proc.poll() is None, f"training exited early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint within {timeout_s}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    return ckpt


def test_a_checkpoint_by_time_is_written_long_before_the_step_cadence_and_a_kill_loses_nothing(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, "trainer.steps=1000", "run.checkpoint_every=1000", "run.checkpoint_every_s=1",
                       "run.eval_at_start=false", log=log)  # (no step-0 evaluation: nothing here reads it)
    try:
        wait_for_steps(proc, run_dir, 1, log)
        ckpt = _wait_for_checkpoint(proc, run_dir, log)
        wait_for_steps(proc, run_dir, step_rows(run_dir) + 1, log)  # rollouts journalled after it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not wait_until_gone(proc.pid, 10.0)
    step = json.loads((ckpt / "manifest.json").read_text())["step"]
    assert 1 <= step < 1000, step  # by time: the step cadence never came
    journalled = journalled_rids(run_dir)
    steps = len(effective_rows(read_jsonl(run_dir / "trained.jsonl"))) + 2
    log = tmp_path / "log-resume.txt"
    proc = resume_train(run_dir, f"trainer.steps={steps}", log=log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    rows = read_jsonl(run_dir / "trained.jsonl")
    at = next(i for i, r in enumerate(rows) if "resume" in r)
    assert rows[at + 1]["step"] == step + 1  # from the checkpoint by time, not from step 0
    audit_exactly_once(run_dir, steps, 1, journalled, "killed after a checkpoint by time")


def test_a_run_stopped_by_its_budget_checkpoints_its_last_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *BASE, "runtime.backend=inprocess", "trainer.steps=1000",
                 "run.checkpoint_every=1000", "run.checkpoint_every_s=null", "trainer.max_wall_s=3",
                 "run.eval_at_start=false", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "wall-clock budget of 3s reached" in out.out + out.err
    last = effective_rows(read_jsonl(run_dir / "trained.jsonl"))[-1]["step"]
    manifest = json.loads((latest_checkpoint(run_dir / "checkpoints") / "manifest.json").read_text())
    assert manifest["step"] == last >= 1
