"""What a user sees on a terminal during a run: the live line keeps the step counter and the
elapsed time at any width (the stats are cut first), and each evaluation leaves a kept line."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from saorl.commands.train import last_line
from saorl.runtime.recorder import RunRecorder, best_of, eval_line, evaluations, step_progress

INFO = "eval acc 0.680 @175 | reward 0.750 | stale 1.25 | idle 0% | 1234 tok/s"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_counter_and_the_elapsed_time_keep_their_width(width):
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=True, color_system=None)
    progress = step_progress(console=console)
    task = progress.add_task("train", total=200, info=INFO)
    progress.update(task, completed=137)
    ev = progress.add_task("eval step 175", total=128, info="")
    progress.update(ev, completed=48)
    console.print(progress.make_tasks_table(progress.tasks))
    train_line, eval_row = buf.getvalue().splitlines()[:2]
    assert "137/200" in train_line and re.search(r" 0:00:\d\d ", train_line), train_line
    assert " 48/128 " in eval_row and len(train_line.rstrip()) <= width
    assert "eval acc 0.680" in train_line  # the stats start with the latest evaluation
    if width >= 120:
        assert train_line.rstrip().endswith("1234 tok/s")  # room for all of it: nothing cut
    else:
        assert train_line.rstrip().endswith("…")  # the stats yield, not the counter


SCRIPT = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from saorl.runtime.recorder import RunRecorder

    rec = RunRecorder(Path(sys.argv[1]), None, progress=True, total_steps=12)
    rec.log_eval(0, 0, {"eval/accuracy": 0.25})
    for step in range(1, 13):
        m = {"step": step, "reward/mean": 0.5, "rollout/staleness_mean": 1.5,
             "time/trainer_idle_frac": 0.01, "throughput/action_tokens_per_s": 1234.0}
        if step % 5 == 0 or step == 12:
            m["eval/accuracy"] = {5: 0.5, 10: 0.375, 12: 0.4375}[step]
            rec.log_eval(step, step, {"eval/accuracy": m["eval/accuracy"]})
        rec.log_step(m)
        time.sleep(0.15)
    rec.close()
''')


def _in_pty(cols: int, args: list[str]) -> str:
    """Run ``args`` with stdout and stderr on a pseudo-terminal ``cols`` columns wide; its output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    env = {**os.environ, "COLUMNS": str(cols), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=30)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("cols", [80, 120])
def test_on_a_real_terminal_every_frame_shows_the_step_and_each_evaluation_stays(tmp_path, cols):
    out = _in_pty(cols, [sys.executable, "-c", SCRIPT, str(tmp_path)])
    frames = [ANSI.sub("", f) for f in re.split(r"[\r\n]", out)]
    bars = [f for f in frames if f.startswith("train")]
    assert bars, out
    for frame in bars:  # every redraw of the live line: the counter and the clock, within the width
        assert re.search(r"\b\d{1,2}/12 0:00:\d\d\b", frame), frame
        assert len(frame.rstrip()) <= cols, frame
    assert any("12/12" in f for f in bars)
    if cols >= 120:  # the terminal's own width is used: room for every stat
        assert any(f.rstrip().endswith("1234 tok/s") for f in bars)
    else:
        assert all(not f.rstrip().endswith("tok/s") for f in bars if "eval acc" in f)
    kept = [f.strip() for f in frames if " eval: accuracy " in f]
    assert kept == ["step 0 eval: accuracy 0.250 (best 0.250 at step 0)",
                    "step 5 eval: accuracy 0.500 (best 0.500 at step 5)",
                    "step 10 eval: accuracy 0.375 (best 0.500 at step 5)",
                    "step 12 eval: accuracy 0.438 (best 0.500 at step 5)"]


def test_without_a_terminal_each_evaluation_and_step_is_a_line(tmp_path, capfd):
    rec = RunRecorder(tmp_path, None, progress=True, total_steps=2)
    rec.log_eval(0, 0, {"eval/accuracy": 0.5})
    rec.log_step({"step": 0, "eval/accuracy": 0.5})
    rec.log_step({"step": 1, "reward/mean": 1.0})
    rec.close()
    err = capfd.readouterr().err.splitlines()
    assert err[0] == "step 0 eval: accuracy 0.500 (best 0.500 at step 0)"
    assert err[2].startswith("step 1 | eval acc 0.500 @0 | reward 1.000 | stale")


def test_a_resumed_run_remembers_its_best_evaluation(tmp_path):
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "eval/accuracy": 0.25}, {"step": 25, "eval/accuracy": 0.625},
        {"step": 50, "eval/accuracy": 0.5}, {"step": 60}]))
    assert evaluations(tmp_path / "eval.jsonl") == [(0, 0.25), (25, 0.625), (50, 0.5)]
    rec = RunRecorder(tmp_path, None, progress=False)
    assert rec.best_eval == (0.625, 25)
    rec.close()
    assert best_of([]) is None and best_of([(1, 0.5), (2, 0.5)]) == (0.5, 1)
    assert eval_line(75, 0.59375, (0.625, 25)) == "step 75 eval: accuracy 0.594 (best 0.625 at step 25)"


def test_the_last_line_gives_the_held_out_accuracy(tmp_path: Path):
    rows = [{"step": 0, "eval/accuracy": 0.4}, {"step": 20, "eval/accuracy": 0.3}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = {"step": 20, "reward/mean": 1.0, "rollout/trained": 4, "eval/accuracy": 0.3}
    assert last_line(tmp_path, final) == ("last step 20: held-out accuracy 0.300 (best 0.400 at step 0); "
                                          "training reward of its 4 trajectories 1.000")
    stopped = {"step": 23, "reward/mean": 0.5, "rollout/trained": 4}
    assert last_line(tmp_path, stopped).startswith(
        "last step 23: not evaluated (stopped early); the last evaluation gave accuracy 0.300 at step 20")
