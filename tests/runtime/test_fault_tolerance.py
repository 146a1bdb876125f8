"""Nothing lost: a killed rollout worker, Ctrl-C. (kill -9 of the trainer at random points, over
several cycles, is in test_fault_injection.py.)"""

import json
import os
import signal

import pytest
from runtime_helpers import read_jsonl, rollout_worker_pids, start_train, wait_for_steps, wait_until_gone

from saorl.runtime.backends.local import LocalBackend, WorkerFailure
from saorl.runtime.backends.messages import PollResult
from saorl.runtime.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow


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


def test_a_stopped_rollout_worker_is_named_killed_and_restarted_within_the_stall_bound(tmp_path):
    """SIGSTOP of the worker: its progress stops, and within its limit (runtime.worker_stall_s, here
    3 s, times the machine's load per core when above 1) it is named, killed and restarted as a
    dead one is; the run trains every step, nothing twice."""
    import re
    import time

    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    # 8 steps: stopped after step 2, the worker leaves at most 8 rollouts (rollout.concurrent_episodes,
    # two steps) to train, so the run must wait for its restart to reach step 8
    proc = start_train(run_dir, "trainer.steps=8", "runtime.worker_stall_s=3", log=log)
    try:
        wait_for_steps(proc, run_dir, 2, log)
        workers = rollout_worker_pids(proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGSTOP)
        t0 = time.monotonic()
        while "made no progress for" not in log.read_text() and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        named = time.monotonic() - t0
        limit = float(re.search(r"its limit (\d+) s", log.read_text()).group(1))
        # the bound, a poll or two, and a loaded 2-core machine's scheduling delays
        assert limit >= 3 and named < limit + 15, (named, log.read_text()[-3000:])

        def gone(pid: int) -> bool:
            try:
                return "Z" in open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
            except OSError:
                return True
        t1 = time.monotonic()  # the kill follows the message: give it a moment to land
        while not gone(workers[0]) and time.monotonic() - t1 < 15:
            time.sleep(0.1)
        assert gone(workers[0]), "the stalled worker was named but not killed"
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "rollout worker 0 made no progress for" in text, text[-3000:]
    assert "runtime.worker_stall_s=3" in text
    assert "killed; restarted" in text
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(9)) and rows[-1]["rollout/worker_restarts"] == 1
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
    assert not wait_until_gone(proc.pid, 10.0)


def test_the_restart_limit_message_counts_the_restarts_done():
    """Five restarts allowed: the sixth death stops the run, saying five were done (not six)."""
    class Dead:
        exitcode = -9

        def is_alive(self) -> bool:
            return False

    backend = LocalBackend(spec=None, num_workers=1, concurrency=1, max_restarts=5)
    spawned = []
    backend._spawn = lambda i: (spawned.append(i), backend._procs.__setitem__(i, Dead()))
    backend._procs[0] = Dead()
    for n in range(1, 6):
        backend._check_alive(PollResult())
        assert backend.restarts == n == len(spawned)
    with pytest.raises(WorkerFailure) as e:
        backend._check_alive(PollResult())
    assert "restarted 5 times already (at most 5 per run)" in str(e.value) and backend.restarts == 5
