"""``saorl plot RUN_DIR``: one PNG of a run, and one paragraph for a directory that is no run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from saorl.runtime.run_plot import NotARunError, plot_run, read_history, read_run, running_mean, series

PNG = b"\x89PNG\r\n\x1a\n"


def _run_dir(path, *, critic: bool = True):
    path.mkdir()
    rows = [{"step": 0, "policy/version": 0, "eval/accuracy": 0.25}]
    for s in range(1, 31):
        r = {"step": s, "reward/mean": s / 30, "mismatch/kl": 1e-3 * s, "policy/update_rel": 1e-3,
             "rollout/staleness_mean": 1.5, "rollout/staleness_max": 3, "time/trainer_idle_frac": 0.01,
             "throughput/action_tokens_per_s": 100.0 + s, "critic/explained_var": 0.5 if critic else None}
        rows.append(r)
    rows.insert(21, {"resume": {"from_step": 18}})  # steps 19, 20 were rolled back and redone
    rows[22:22] = [dict(rows[19], step=19), dict(rows[20], step=20)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 31, "rew')
    evals = [{"step": s, "eval/accuracy": a} for s, a in [(0, 0.25), (10, 0.5), (20, 0.625), (30, 0.5)]]
    (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return path


def test_a_run_is_one_png_in_its_directory(tmp_path):
    run = _run_dir(tmp_path / "run")
    steps, evals = read_run(run)
    assert [r["step"] for r in steps] == list(range(1, 31))  # the resume marker applied, step 0 left out
    assert series(evals, "eval/accuracy") == ([0, 10, 20, 30], [0.25, 0.5, 0.625, 0.5])
    out = plot_run(run)
    assert out == run / "run.png" and out.read_bytes()[:8] == PNG and out.stat().st_size > 20_000


def test_a_metric_the_run_did_not_log_is_a_note_not_an_error(tmp_path):
    run = _run_dir(tmp_path / "grpo", critic=False)
    assert series(read_run(run)[0], "critic/explained_var") == ([], [])
    assert plot_run(run, tmp_path / "elsewhere" / "grpo.png").read_bytes()[:8] == PNG


def test_running_mean():
    assert running_mean([1.0, 3.0, 5.0, 7.0], n=2) == [1.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("make, expected", [
    (lambda p: p, "has no metrics.jsonl, so it is not a saorl run directory"),
    (lambda p: p / "missing", "is not a directory"),
])
def test_a_directory_that_is_no_run_is_refused(tmp_path, make, expected):
    with pytest.raises(NotARunError, match=expected):
        read_run(make(tmp_path))


def test_the_command(tmp_path):
    run = _run_dir(tmp_path / "run")
    cmd = [sys.executable, "-m", "saorl.cli", "plot"]
    ok = subprocess.run([*cmd, str(run), "--out", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "x.png"), ok.stderr
    bad = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a saorl run directory" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "run.png").exists()


def _killed_and_resumed(path):
    """A run killed at step 3 without a checkpoint, resumed from step 0 (versions continue above the
    4 published before the kill), then killed again at step 2 of its second start."""
    path.mkdir()
    life1 = [{"step": 0, "policy/version": 0, "eval/accuracy": 0.0}] + [
        {"step": s, "policy/version": s, "rollout/staleness_mean": 1.0} for s in (1, 2, 3)]
    marker = {"resume": {"from_step": 0, "checkpoint": None, "pending": 6, "version": 4, "time": 1.0}}
    life2 = [{"step": 0, "policy/version": 4, "eval/accuracy": 0.0}] + [
        {"step": s, "policy/version": 4 + s, "rollout/staleness_mean": 1.0} for s in (1, 2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*life1, marker, *life2]))
    evals = [{"step": 0, "policy/version": 0, "eval/accuracy": 0.0},
             {"step": 2, "policy/version": 2, "eval/accuracy": 0.5},  # rolled back by the resume
             {"step": 0, "policy/version": 4, "eval/accuracy": 0.25}]  # the step-0 evaluation redone
    (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return path


def test_each_step_once_resumes_marked_and_a_killed_run_said_so(tmp_path):
    run = _killed_and_resumed(tmp_path / "run")
    steps, evals, history = read_history(run)
    assert [r["step"] for r in steps] == [1, 2]
    assert [(e["step"], e["eval/accuracy"]) for e in evals] == [(0, 0.25)]  # once, the newest
    assert history.resumes == [0] and history.killed and not history.running
    assert history.describe(2) == ("resumed from step 0; stopped without finishing at step 2 (killed; saorl "
                                   "train --resume continues it)")
    assert plot_run(run).read_bytes()[:8] == PNG


def test_an_end_record_after_the_last_start_is_a_run_that_ended(tmp_path):
    run = _killed_and_resumed(tmp_path / "run")
    (run / "end.json").write_text(json.dumps({"step": 2, "steps": 9, "why": "budget", "time": 2.0}))
    history = read_history(run)[2]
    assert not history.killed and history.describe(2) == "resumed from step 0; ended at step 2 (budget)"
    with open(run / "metrics.jsonl", "a") as f:  # a later start that was killed: that end no longer counts
        f.write(json.dumps({"resume": {"from_step": 2, "version": 7, "time": 3.0}}) + "\n")
    assert read_history(run)[2].killed
