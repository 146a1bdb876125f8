"""``saorl experiment --jobs N``: runs side by side in processes of their own (real processes): they
overlap in time and give what the serial runner gives (done.json, the step-0 row, the report); a
SIGTERM to the parent stops its children, leaves no process behind and the same command resumes; a
child that fails stops the experiment with its log's tail; a bad ``--run`` is named."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from saorl.cli import main
from tests.experiments.test_experiment_e2e import TINY

ROOT = Path(__file__).resolve().parents[2]


def _span(run: Path) -> tuple[float, float]:
    """When a run began (its config written) and ended (done.json written)."""
    return (run / "config.yaml").stat().st_mtime, (run / "done.json").stat().st_mtime


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_runs_side_by_side_then_the_start_arm_and_the_report(tmp_path: Path, capsys):
    out = tmp_path / "math"
    argv = ["experiment", "math", *TINY, "runtime.trainer_threads=1", "--quick", "--out", str(out),
            "--arms", "sao,grpo_sync,sft", "--jobs", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 run(s), 2 at a time" in printed and "[sao seed 0] done: 3 steps" in printed
    (a0, a1), (b0, b1) = _span(out / "sao" / "seed-0"), _span(out / "grpo_sync" / "seed-0")
    assert a0 < b1 and b0 < a1  # side by side, not one after the other
    for arm in ("sao", "grpo_sync"):
        assert json.loads((out / arm / "seed-0" / "done.json").read_text())["steps"] == 3
        assert "training:" in (out / "logs" / f"{arm}-seed0.log").read_text()
        evals = [json.loads(x) for x in (out / arm / "seed-0" / "eval.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [0, 2, 3]
    # the same SFT policy, tasks and sampling seed: one step-0 accuracy, whichever run evaluated it
    starts = [json.loads((out / a / "seed-0" / "eval.jsonl").read_text().splitlines()[0])
              for a in ("sao", "grpo_sync", "sft")]
    assert all(s["step"] == 0 for s in starts) and len({s["eval/accuracy"] for s in starts}) == 1
    assert len(list((out / ".cache").glob("sft-*"))) == 1  # made once, by the parent; the runs reuse it
    assert all("sft: using the cached warm start" in (out / "logs" / f"{a}-seed0.log").read_text()
               for a in ("sao", "grpo_sync"))
    table = (out / "report.md").read_text().split("## Comparisons")[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["arm", "grpo_sync", "sao", "sft"]  # in the spec's order, as after a serial run
    assert main(argv) == 0  # again: everything finished earlier, nothing started
    assert "0 run(s), 2 at a time" in capsys.readouterr().out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is not running
        return fh.read().split(") ")[1][0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_the_children_and_the_same_command_resumes(tmp_path: Path):
    out = tmp_path / "math"
    args = ["experiment", "math", *TINY, "trainer.steps=30", "runtime.trainer_threads=1",
            "run.checkpoint_every=1", "--quick", "--out", str(out), "--arms", "sao,grpo_sync", "--jobs", "2"]
    cmd = [sys.executable, "-c", "import sys; from saorl.cli import main; sys.exit(main(sys.argv[1:]))",
           *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    parent = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
    lines, pids = [], []
    deadline = time.monotonic() + 400
    while len(pids) < 2 and time.monotonic() < deadline:
        line = parent.stdout.readline()
        lines.append(line)
        pids += [int(p) for p in re.findall(r"started \(pid (\d+)\)", line)]
    assert len(pids) == 2, "".join(lines)
    metrics = [out / arm / "seed-0" / "metrics.jsonl" for arm in ("sao", "grpo_sync")]

    def past_a_checkpoint(m: Path) -> bool:
        steps = [json.loads(x).get("step", 0) for x in m.read_text().splitlines()] if m.is_file() else []
        return max(steps, default=0) >= 1 and any((m.parent / "checkpoints").glob("*"))

    while not all(past_a_checkpoint(m) for m in metrics) and time.monotonic() < deadline:
        time.sleep(0.2)  # both runs past their first step and its checkpoint
    parent.send_signal(signal.SIGTERM)
    rest, _ = parent.communicate(timeout=360)
    assert parent.returncode == 130, rest
    assert "stopped (Ctrl-C or SIGTERM)" in rest and "asked to stop" in rest
    assert not any(_alive(p) for p in pids)
    assert not any((out / arm / "seed-0" / "done.json").exists() for arm in ("sao", "grpo_sync"))
    at_stop = {arm: max(json.loads(x).get("step", 0) for x in m.read_text().splitlines())
               for arm, m in zip(("sao", "grpo_sync"), metrics)}
    # the same command: both runs resume from their checkpoints and finish (30 steps, or the quick
    # spec's 60 s of wall clock, counted across the stop)
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for arm in ("sao", "grpo_sync"):
        assert "resuming" in (out / "logs" / f"{arm}-seed0.log").read_text()
        assert json.loads((out / arm / "seed-0" / "done.json").read_text())["steps"] >= at_stop[arm] >= 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_child_stops_the_experiment_with_its_log(tmp_path: Path, capsys):
    out = tmp_path / "math"
    (out / "sao").mkdir(parents=True)
    (out / "sao" / "seed-0").write_text("in the way")  # the run's directory is a file: its child fails
    argv = ["experiment", "math", *TINY, "--quick", "--out", str(out), "--arms", "sao,grpo_sync",
            "--jobs", "2"]
    assert main(argv) == 1  # failed, not stopped
    err = capsys.readouterr().err
    assert "[sao seed 0] exited with status 1" in err and "NotADirectoryError" in err
    assert "run the same command again to resume" in err
    assert (out / "sao" / "seed-0").read_text() == "in the way"  # nothing of it deleted


def test_bad_jobs_and_run_are_named(tmp_path: Path, capsys):
    assert main(["experiment", "math", "--quick", "--out", str(tmp_path / "o"), "--jobs", "0"]) == 2
    assert "--jobs must be >= 1, got 0" in capsys.readouterr().err
    for bad in ("nope:0", "sao:-1", "sao:--1", "sao:x", ":0", "sao", "sft:0"):
        assert main(["experiment", "math", "--quick", "--out", str(tmp_path / "o"), "--run", bad]) == 2
        assert "--run ARM:SEED with a trained arm of 'math' (grpo_async, " in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
