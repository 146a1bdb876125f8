"""The Ray backend on a private local cluster: same metrics, exactly once, a killed actor, clean exit.

Each test starts its own cluster through the run's config (``ray.num_cpus=4`` logical CPUs for
the trainer and two workers, a short session directory under /tmp: Unix socket paths must stay
under 107 bytes, and a pytest path is longer) with token auth off, and checks at the end that
none of that cluster's processes is left. One lets saorl make the session directory
(``/tmp/saorl-ray-*``), kills the whole process group and checks that the reaper removes it (and
that the next run removes one a killed reaper would leave).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import BASE, read_jsonl, session_pids, start_train, wait_for_steps, wait_until_gone

from saorl.config import load_config
from saorl.runtime.backends.lifeline import OWNER, descendants
from saorl.runtime.checkpoint import latest_checkpoint
from saorl.runtime.journal import RangeSet
from saorl.runtime.observe import Observer
from saorl.training import train

ray = pytest.importorskip("ray", reason="the Ray backend needs ray installed (pip install -e '.[ray]')")
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def ray_dir(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # Ray >= 2.59 turns token auth on by default
    d = tempfile.mkdtemp(prefix="sr-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def cluster_processes(temp_dir: str) -> list[str]:
    """Command lines of the Ray daemons (raylet, gcs_server, ...) whose session is under ``temp_dir``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if temp_dir in cmd:
                out.append(cmd)
    return out


def ray_args(temp_dir: str, *extra: str) -> list[str]:
    return [*BASE, "runtime.backend=ray", "ray.num_cpus=4", "ray.worker_cpus=1", "ray.trainer_cpus=1",
            f"ray.temp_dir={temp_dir}", "rollout.concurrent_episodes=4", "rollout.engine.slots=4",
            "runtime.trainer_threads=1", *extra]


class KillWorker(Observer):
    """From step ``at`` on, ``kill -9`` the process of Ray actor ``saorl-rollout-0`` once its engine
    runs weights of version >= ``at - 1`` (published after step ``at - 1``) and it is playing
    rollouts; notes the Ray daemons.

    The kill comes from a thread, so the run loop keeps dispatching meanwhile: an observer that
    blocked the loop would let the actor finish and hand back all it had (nothing to re-queue).
    ``step_done`` of step ``at + 2`` waits for the kill and (``restarts``) for the restarted
    incarnation to answer: by then Ray has failed the calls that were in flight to the dead one,
    so the backend counts the death at its next poll, whatever the machine's load."""

    def __init__(self, at: int, temp_dir: str, restarts: bool = True) -> None:
        self.at, self.temp_dir, self.restarts = at, temp_dir, restarts
        self.killed: int | None = None
        self.engine_version = -1
        self.playing = 0  # rollouts the actor was playing just before the kill
        self.daemons: list[str] = []
        self._thread: threading.Thread | None = None

    def step_done(self, step, metrics, trajectories) -> None:
        if step == self.at:
            self.daemons = [c for c in cluster_processes(self.temp_dir) if "raylet" in c or "gcs_server" in c]
            self._thread = threading.Thread(target=self._kill, daemon=True)
            self._thread.start()
        elif step == self.at + 2 and self._thread is not None:
            self._thread.join(timeout=180)

    def _kill(self) -> None:
        actor = ray.get_actor("saorl-rollout-0")
        pid = ray.get(actor.pid.remote())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.engine_version = int(ray.get(actor.stats.remote(0.0)).stats["version"])
            self.playing = ray.get(actor.playing.remote())
            if self.engine_version >= self.at - 1 and self.playing > 0:
                break
            time.sleep(0.01)
        else:
            return  # never busy with published weights: the test's asserts say so
        os.kill(pid, signal.SIGKILL)
        self.killed = pid
        while self.restarts and time.monotonic() < deadline + 60:
            try:
                if ray.get(actor.pid.remote(), timeout=10) != pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.1)


def _pending(ckpt: Path) -> set[int]:
    return {json.loads(line)["rid"] for line in (ckpt / "pending.jsonl").read_text().splitlines()}


def test_ray_run_survives_a_killed_actor_trains_each_rollout_once_and_leaves_no_process(tmp_path, ray_dir):
    local = load_config(None, [*BASE, "trainer.steps=2", "rollout.concurrent_episodes=4",
                               "rollout.engine.slots=4"])
    local_dir, _ = train(local, tmp_path / "local")
    cfg = load_config(None, ray_args(ray_dir, "rollout.num_workers=2", "trainer.steps=8"))
    kill = KillWorker(at=2, temp_dir=ray_dir)
    run_dir, _ = train(cfg, tmp_path / "ray", observer=kill)

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]  # (step 0: evaluation)
    assert [r["step"] for r in rows] == list(range(1, 9))
    local_rows = [r for r in read_jsonl(local_dir / "metrics.jsonl") if r["step"] > 0]
    # the same metrics as the local backend, but for those that depend on the data or the timing:
    # the slot utilisation appears once a worker's engine stats (sent about once a second) count
    # decode steps; a mismatch bucket appears when a batch has tokens of that staleness
    def stable(keys: set[str]) -> set[str]:
        return {k for k in keys if k != "rollout/slot_util" and not re.match(r"mismatch/.*_s\d", k)}

    keys, local_keys = set().union(*rows), set().union(*local_rows)
    assert "rollout/slot_util" in keys and "mismatch/kl_s0" in keys
    assert stable(keys) == stable(local_keys)
    assert kill.killed is not None and kill.engine_version >= 1  # weights reached the actor
    assert kill.playing > 0
    assert rows[-1]["rollout/worker_restarts"] >= 1
    assert rows[-1]["rollout/requeued"] > 0
    trained = read_jsonl(run_dir / "trained.jsonl")
    # exactly once: no rid in two steps; every journalled rid trained or pending at the end
    rids = [rid for row in trained for rid in row["rids"]]
    assert len(rids) == len(set(rids)) == 8 * 4
    final = latest_checkpoint(run_dir / "checkpoints")
    finished = set(RangeSet.from_ranges(json.loads((final / "manifest.json").read_text())["finished"]))
    pending = _pending(final)
    assert set(rids) | pending == finished and not set(rids) & pending
    # the private cluster is gone: its daemons ran during the run, none is left
    assert kill.daemons, "no raylet / gcs_server of this test's cluster was seen during the run"
    time.sleep(1.0)
    assert cluster_processes(ray_dir) == []


def test_ray_run_past_the_restart_limit_stops_with_one_paragraph(tmp_path, ray_dir):
    cfg = load_config(None, ray_args(ray_dir, "rollout.num_workers=1", "trainer.steps=50",
                                     "ray.max_restarts=0", "ray.weights=object_store"))
    kill = KillWorker(at=2, temp_dir=ray_dir, restarts=False)  # max_restarts=0: none
    with pytest.raises(RuntimeError) as info:
        train(cfg, tmp_path / "ray", observer=kill)
    message = str(info.value.__cause__ or info.value)
    assert "ray.max_restarts=0" in message and "rollout worker 0" in message
    assert "\n" not in message
    assert kill.engine_version >= 1  # the actor's engine loaded published weights, via the object store
    time.sleep(1.0)
    assert cluster_processes(ray_dir) == []


def test_a_trainer_killed_with_sigkill_leaves_no_ray_process(tmp_path, ray_dir):
    """``kill -9`` of the trainer alone: its cluster's daemons and actors (Ray's agents would linger
    a minute on their own) are gone within 10 s; the journal then resumes as after any crash."""
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = start_train(run_dir, *ray_args(ray_dir, "rollout.num_workers=1", "trainer.steps=1000")[len(BASE):],
                       log=log)
    try:
        wait_for_steps(proc, run_dir, 2, log)
        seen = session_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(seen) >= 5, seen  # trainer, reaper, gcs_server, raylet, agents, the actor
    left = wait_until_gone(proc.pid, 10.0)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left]
    assert cluster_processes(ray_dir) == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _mine(pattern: str = "/tmp/saorl-ray-*") -> list[Path]:
    """saorl-made session directories whose owner marker names this process."""
    return [d for d in map(Path, glob.glob(pattern))
            if (d / OWNER).is_file() and (d / OWNER).read_text().split()[1:2] == [str(os.getpid())]]


def test_a_killed_process_group_leaves_no_session_directory_and_orphans_are_removed(tmp_path, ray_dir):
    """``kill -9`` of the whole process group: the reaper, in a session of its own, removes the
    session directory saorl made; one left by a reaper killed too (marked with its dead owner) is
    removed when the next private cluster starts. Neither cluster runs Ray's ``dashboard.py``."""
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    args = [a for a in ray_args(ray_dir, "rollout.num_workers=1", "trainer.steps=1000")[len(BASE):]
            if not a.startswith("ray.temp_dir=")]
    proc = start_train(run_dir, *args, log=log)
    try:
        wait_for_steps(proc, run_dir, 2, log)
        commands = [_cmdline(p) for p in session_pids(proc.pid)]
        session = {m.group(0) for c in commands for m in [re.search(r"/tmp/saorl-ray-[a-z0-9_]+", c)] if m}
        owner = (Path(next(iter(session))) / OWNER).read_text() if len(session) == 1 else None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(session) == 1 and owner is not None, commands
    temp = Path(session.pop())
    assert any("raylet" in c for c in commands) and any("dashboard/agent.py" in c for c in commands)
    assert not [c for c in commands if "dashboard/dashboard.py" in c]  # the agent is not the dashboard
    assert not wait_until_gone(proc.pid, 10.0)
    deadline = time.monotonic() + 10
    while temp.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not temp.exists()  # the reaper outlived the group's kill and removed it
    temp = Path(f"{temp}-orphan")  # what a reaper killed too would leave: marked, its owner dead
    temp.mkdir()
    (temp / OWNER).write_text(owner)

    cfg = load_config(None, [a for a in ray_args(ray_dir, "rollout.num_workers=1", "trainer.steps=1")
                             if not a.startswith("ray.temp_dir=")])
    seen: list[str] = []

    class Look(Observer):
        def step_done(self, step, metrics, trajectories) -> None:
            seen.extend(_cmdline(p) for p in descendants(os.getpid()))

    train(cfg, tmp_path / "again", observer=Look())
    assert not temp.exists()  # the orphan, removed when the next private cluster started
    assert any("raylet" in c for c in seen) and not [c for c in seen if "dashboard/dashboard.py" in c]
    assert _mine() == []  # and this run's own, at its end
