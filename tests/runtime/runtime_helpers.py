"""Shared helpers for the end-to-end runtime tests (real processes, real kills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from saorl.data.jsonl import read_jsonl
from saorl.runtime.checkpoint import latest_checkpoint
from saorl.runtime.journal import Journal, RangeSet, decode_entry
from saorl.runtime.observe import Observer
from saorl.runtime.recorder import effective_rows

__all__ = ["BASE", "SYNC_MISMATCH_BASE", "KeepTrajectories", "audit_exactly_once", "journalled_rids",
           "read_jsonl",
           "resume_train",
           "rollout_worker_pids", "session_pids", "start_train", "step_rows", "turns", "wait_for_steps",
           "wait_until_gone"]

# Small but real: the tiny MoE policy, math_tool, workers in their own processes.
BASE = [
    "sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-moe",
    "env.num_train_tasks=400", "env.num_test_tasks=8",
    "run.eval_every=1000", "run.eval_tasks=4", "run.samples_every=1000", "run.checkpoint_every=1000",
    "run.progress=false", "rollout.concurrent_episodes=8", "rollout.engine.slots=8",
    "rollout.max_new_tokens=12", "rollout.max_total_tokens=80", "trainer.batch_size=4",
]

# Two sync steps in one process (the staleness-0 mismatch of every token is measured): the engine/
# trainer mismatch tests, with the local engine or a server.
SYNC_MISMATCH_BASE = [
    "sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-moe",
    "runtime.backend=inprocess", "runtime.mode=sync", "env.num_train_tasks=50", "env.num_test_tasks=4",
    "run.eval_tasks=2", "run.eval_every=1000", "run.samples_every=1000", "run.checkpoint_every=1000",
    "run.progress=false", "rollout.concurrent_episodes=4", "rollout.engine.slots=4",
    "rollout.max_new_tokens=12", "rollout.max_total_tokens=80", "trainer.batch_size=4", "trainer.steps=2",
]


def _popen(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``saorl train ARGS`` in its own session (so its sid is its pid: every process of the run)."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "saorl.cli", "train", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_train(run_dir: Path, *args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return _popen([*BASE, *args, "--run-dir", str(run_dir)], log, env)


def resume_train(run_dir: Path, *overrides: str, log: Path) -> subprocess.Popen:
    return _popen(["--resume", str(run_dir), *overrides], log)


def step_rows(run_dir: Path) -> int:
    """Step rows in trained.jsonl so far (resume markers not counted, redone steps counted)."""
    return sum("step" in r for r in read_jsonl(run_dir / "trained.jsonl"))


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, log: Path, timeout_s: float = 240) -> None:
    """Until trained.jsonl has ``n`` step rows (counting redone steps)."""
    deadline = time.monotonic() + timeout_s
    while step_rows(run_dir) < n:
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
        # named as it starts (saorl.proctitle); spawn's command line until then
        if cmd.startswith("saorl: rollout worker") or ("multiprocessing.spawn" in cmd
                                                       and "resource_tracker" not in cmd):
            pids.append(c)
    return pids


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: a run started by ``_popen`` and all it spawned."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
                out.append(int(d.name))
    return out


def wait_until_gone(sid: int, timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for session ``sid`` to have no live process; what is left."""
    deadline = time.monotonic() + timeout_s
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def journalled_rids(run_dir) -> set[int]:
    return {t.episode.rid for t in Journal(run_dir / "journal").read_from(0)}


def audit_exactly_once(run_dir, steps: int, resumes: int, journalled: set[int], why: str) -> None:
    """Every journalled rollout trained exactly once (or still pending in the final checkpoint)."""
    rows = read_jsonl(run_dir / "trained.jsonl")
    assert sum("resume" in r for r in rows) == resumes, why
    eff = effective_rows(rows)
    assert [r["step"] for r in eff] == list(range(1, steps + 1)), why
    metrics = [r for r in effective_rows(read_jsonl(run_dir / "metrics.jsonl")) if r["step"] > 0]
    assert [r["step"] for r in metrics] == [r["step"] for r in eff], why  # (step 0: the evaluation)
    rids = [rid for r in eff for rid in r["rids"]]
    assert len(rids) == len(set(rids)), f"a rollout was trained twice; {why}"
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == steps, why
    finished = set(RangeSet.from_ranges(manifest["finished"]))
    pending = {decode_entry(line).episode.rid for line in (ckpt / "pending.jsonl").read_text().splitlines()}
    assert not pending & set(rids), why
    assert finished == set(rids) | pending, f"finished but neither trained nor pending; {why}"
    assert journalled <= finished, f"journalled rollouts lost: {sorted(journalled - finished)}; {why}"


class KeepTrajectories(Observer):
    """Every trajectory a run trains on, in order."""

    def __init__(self) -> None:
        self.trajectories = []

    def step_done(self, step, metrics, trajectories) -> None:
        self.trajectories += trajectories


def turns(traj):
    """(version, [positions]) of each contiguous run of action tokens of one version (a request,
    or the part of one that a version sampled)."""
    out, cur = [], None
    for t, m in enumerate(traj.action_mask):
        if m and cur is not None and cur[1][-1] == t - 1 and cur[0] == traj.versions[t]:
            cur[1].append(t)
        elif m:
            cur = (traj.versions[t], [t])
            out.append(cur)
    return out
