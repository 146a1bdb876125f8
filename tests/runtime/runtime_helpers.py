"""Shared helpers for the end-to-end runtime tests (real processes, real kills)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from saorl.data.jsonl import read_jsonl

__all__ = ["BASE", "SYNC_MISMATCH_BASE", "read_jsonl", "rollout_worker_pids", "start_train", "wait_for_steps"]

# Small but real: the tiny MoE policy, math_tool, workers in their own processes.
BASE = [
    "sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-moe",
    "env.num_train_tasks=400", "env.num_test_tasks=8",
    "run.eval_every=1000", "run.eval_tasks=4", "run.samples_every=1000", "run.checkpoint_every=1000",
    "run.progress=false", "rollout.concurrent_episodes=8", "rollout.engine_slots=8",
    "rollout.max_new_tokens=12", "rollout.max_total_tokens=80", "trainer.batch_size=4",
]

# Two sync steps in one process (the staleness-0 mismatch of every token is measured): the engine/
# trainer mismatch tests, with the local engine or a server.
SYNC_MISMATCH_BASE = [
    "sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-moe",
    "runtime.backend=inprocess", "runtime.mode=sync", "env.num_train_tasks=50", "env.num_test_tasks=4",
    "run.eval_tasks=2", "run.eval_every=1000", "run.samples_every=1000", "run.checkpoint_every=1000",
    "run.progress=false", "rollout.concurrent_episodes=4", "rollout.engine_slots=4",
    "rollout.max_new_tokens=12", "rollout.max_total_tokens=80", "trainer.batch_size=4", "trainer.steps=2",
]


def start_train(run_dir: Path, *args: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "saorl.cli", "train", *BASE, *args, "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while len(read_jsonl(run_dir / "trained.jsonl")) < n:
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {n} steps within {timeout_s}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append(int(d.name))
    return out


def rollout_worker_pids(trainer_pid: int) -> list[int]:
    pids = []
    for c in children(trainer_pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd:
            pids.append(c)
    return pids
