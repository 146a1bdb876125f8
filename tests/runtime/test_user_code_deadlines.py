"""A reward function that never returns, end to end (real processes, real signals): its calls run past
``env.call_timeout_s`` into failed rollouts and failed evaluation episodes, and Ctrl-C / SIGTERM end
the run within ``trainer.stop_timeout_s`` with the last checkpoint intact."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from runtime_helpers import read_jsonl, start_train, wait_for_steps, wait_until_gone
from safetensors.torch import load_file

from saorl.runtime.checkpoint import latest_checkpoint, verify
from saorl.runtime.journal import Journal

pytestmark = pytest.mark.slow

REWARDS = '''
import os, time

def hang_once_marked(prompt, completion, **row):
    """Scores until the marker file exists, then never returns (sleeping: the CPU stays free)."""
    if os.path.exists(os.environ["SAORL_TEST_HANG_MARKER"]):
        time.sleep(10**9)
    return 1.0 if "1" in completion else 0.0

def busy(prompt, completion, **row):
    while True:  # never yields
        pass
'''


def _setup(tmp_path: Path, fn: str) -> tuple[list[str], dict[str, str], Path]:
    """Overrides for a prompt_reward run scored by ``fn``, its environment, and the hang marker."""
    (tmp_path / "hang_rewards.py").write_text(REWARDS)
    for split, n in (("train", 64), ("test", 4)):
        rows = [{"id": f"{split}-{i}", "prompt": f"What is {i}+1? ", "answer": i + 1} for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    marker = tmp_path / "hang-now"
    env = dict(os.environ, SAORL_TEST_HANG_MARKER=str(marker),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    overrides = ["env.type=prompt_reward", f"env.tasks_file={tmp_path / 'train.jsonl'}",
                 f"env.test_tasks_file={tmp_path / 'test.jsonl'}", f"env.options.reward_fn=hang_rewards:{fn}",
                 "rollout.concurrent_episodes=4", "rollout.engine.slots=4", "rollout.max_new_tokens=6",
                 "rollout.max_total_tokens=32"]
    return overrides, env, marker


def _hosts(marker: Path) -> list[int]:
    """Live processes whose environment names ``marker``: the run's and its children (hosts included)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"SAORL_TEST_HANG_MARKER={marker}".encode() in (d / "environ").read_bytes().split(b"\0") \
                        and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _stop(proc, sig: int, second_after: float | None = None, timeout_s: float = 120.0) -> tuple[int, float]:
    """Send ``sig`` to the run's process group (again after ``second_after`` s): (exit status, seconds
    from the first signal to the exit)."""
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    if second_after is not None:
        time.sleep(second_after)
        os.killpg(proc.pid, sig)
    rc = proc.wait(timeout=timeout_s)
    took = time.monotonic() - t0
    print(f"exit status {rc}, {took:.1f} s after the first {signal.Signals(sig).name}")  # shown with -s
    return rc, took


def _hang_after_two_steps(tmp_path: Path, *args: str):
    overrides, env, marker = _setup(tmp_path, "hang_once_marked")
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, *overrides, "trainer.steps=1000", "run.checkpoint_every=1",
                       "env.call_timeout_s=600", *args, log=log, env=env)
    wait_for_steps(proc, run_dir, 2, log)
    marker.touch()  # from now on every reward call hangs, far inside its 600 s deadline
    deadline = time.monotonic() + 60
    while not any("saorl: reward host" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
                  for p in _hosts(marker) if Path(f"/proc/{p}").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(2.0)  # the calls in flight are past the marker: nothing finishes any more
    return proc, run_dir, log, marker


def _intact_checkpoint(run_dir: Path) -> int:
    """The step of the latest checkpoint, after verifying every file of it and loading its weights."""
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None
    manifest = verify(ckpt, Journal(run_dir / "journal"))
    assert load_file(ckpt / "policy.safetensors")
    return int(manifest["step"])


def _all_gone(proc, marker: Path) -> None:
    assert not wait_until_gone(proc.pid, 10.0)
    deadline = time.monotonic() + 10.0
    while _hosts(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _hosts(marker), "a process of the run (a host of the reward function) outlived it"


def test_sigterm_while_the_reward_function_hangs_forever_stops_cleanly_within_the_bound(tmp_path):
    proc, run_dir, log, marker = _hang_after_two_steps(tmp_path, "trainer.stop_timeout_s=60")
    try:
        rc, took = _stop(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0 and took < 60.0, (rc, took, text[-3000:])
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert _intact_checkpoint(run_dir) == steps[-1] >= 2
    assert (run_dir / "final" / "policy" / "config.json").exists()
    assert "stopping: finishing the current step" in text and "stopping at once" not in text
    _all_gone(proc, marker)


def test_a_stop_that_overruns_its_bound_is_forced_and_the_last_checkpoint_stays_intact(tmp_path):
    # the workers' episodes hang, so stopping them alone takes the backend's 5 s grace: past 2 s
    proc, run_dir, log, marker = _hang_after_two_steps(tmp_path, "trainer.stop_timeout_s=2")
    try:
        rc, took = _stop(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 130 and 2.0 <= took < 12.0, (rc, took, text[-3000:])
    assert "stopping at once: the stop was not done within 2 s (trainer.stop_timeout_s)" in text
    assert _intact_checkpoint(run_dir) >= 2
    _all_gone(proc, marker)


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    proc, run_dir, log, marker = _hang_after_two_steps(tmp_path, "trainer.stop_timeout_s=600")
    try:
        rc, took = _stop(proc, signal.SIGINT, second_after=0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 130 and took < 10.0, (rc, took, text[-3000:])
    assert "stopping at once: a second Ctrl-C" in text
    assert _intact_checkpoint(run_dir) >= 2
    _all_gone(proc, marker)


def test_sigterm_during_a_step_0_evaluation_that_hangs_drops_it_and_exits(tmp_path):
    overrides, env, marker = _setup(tmp_path, "hang_once_marked")
    marker.touch()  # every reward call hangs, the step-0 evaluation's first
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, *overrides, "env.call_timeout_s=600", "trainer.stop_timeout_s=60",
                       log=log, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(_hosts(marker)) < 3:  # the trainer, a worker, a host of an evaluation call at least
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2.0)
        rc, took = _stop(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0 and took < 60.0, (rc, took, text[-3000:])
    assert "eval step 0: dropped, the run is stopping" in text
    assert not (run_dir / "metrics.jsonl").read_text().strip()  # no step-0 row, no step
    _all_gone(proc, marker)


def test_a_busy_loop_reward_fails_its_rollouts_until_the_failure_budget_stops_the_run(tmp_path):
    overrides, env, marker = _setup(tmp_path, "busy")
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, *overrides, "env.call_timeout_s=2", "rollout.concurrent_episodes=2",
                       log=log, env=env)
    try:
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 3, text[-3000:]
    timeout = "reward function 'hang_rewards:busy' on task 'train-"
    last = text.strip().splitlines()[-1]
    # Two budgets stop it, whichever a poll fills first: one rollout failing 4 times, or 8 timeouts in a
    # row across rollouts (with 2 in flight the 4th failure of rollout 0 and the 8th timeout can land
    # in one poll). Either names the function and its deadline.
    assert last.startswith("saorl train: the run failed: ")
    assert ("failed 4 times, the last time: " in last
            or "rollouts all ran past env.call_timeout_s and none finished in between" in last), last
    assert timeout in last and "did not return within 2 s (env.call_timeout_s)" in last
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert evals[0]["eval/failed"] == 4 and evals[0]["eval/accuracy"] == 0.0
    errors = (run_dir / "errors.log").read_text()
    assert "4 of 4 evaluation episodes failed" in errors and errors.count(timeout) >= 4
    assert "bug in saorl" not in text
    _all_gone(proc, marker)
