"""The reaper: what it was told about dies with the process that told it, however that one died."""

from __future__ import annotations

import subprocess
import sys
import time

from saorl.runtime.backends.lifeline import descendants, start_time

# a "trainer" that starts two sleepers, tells a reaper about the first only (and about the second
# with a wrong start time: a reused pid), prints their pids, then waits to be killed
TRAINER = """
import os, subprocess, sys, time
from saorl.runtime.backends.lifeline import Reaper
watched, reused = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
reaper = Reaper()
reaper.watch([watched.pid])
reaper._send(f"pid {reused.pid} 1")
if sys.argv[1] == "close":
    reaper.close()
print(watched.pid, reused.pid, reaper._proc.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    return start_time(pid) is not None and "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]


def _run(mode: str) -> tuple[int, int, int]:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, mode], stdout=subprocess.PIPE, text=True)
    watched, reused, reaper = map(int, trainer.stdout.readline().split())
    assert set(descendants(trainer.pid)) >= {watched, reused}
    trainer.kill()  # SIGKILL: no clean-up code runs
    trainer.wait()
    deadline = time.monotonic() + 5
    while _alive(reaper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(reaper)
    return watched, reused, reaper


def _stop(*pids: int) -> None:
    for pid in pids:
        if _alive(pid):
            subprocess.run(["kill", "-9", str(pid)])


def test_what_the_reaper_watches_dies_with_its_trainer_and_nothing_else():
    watched, reused, _ = _run("kill")
    try:
        assert not _alive(watched)
        assert _alive(reused)  # its start time did not match: a pid reused by someone else is spared
    finally:
        _stop(watched, reused)


def test_a_reaper_closed_in_order_kills_nothing():
    watched, reused, _ = _run("close")
    try:
        assert _alive(watched) and _alive(reused)
    finally:
        _stop(watched, reused)


GROUP = """
import os, sys, time
from saorl.runtime.backends.lifeline import Reaper
reaper = Reaper()
reaper.remove_dir(sys.argv[1])
print(reaper._proc.pid, flush=True)
time.sleep(60)
"""


def test_kill_9_of_the_whole_process_group_still_removes_the_private_clusters_directory(tmp_path):
    """A Ray run's ``saorl-ray-*`` directory: the reaper is outside the trainer's process group, so
    ``kill -9 -PGID`` (a terminal's or a scheduler's kill of the job) does not take it along."""
    import os
    import signal

    session = tmp_path / "saorl-ray-x"
    (session / "logs").mkdir(parents=True)
    trainer = subprocess.Popen([sys.executable, "-c", GROUP, str(session)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)  # a group of its own, as a job has
    reaper = int(trainer.stdout.readline())
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 5
    while (session.exists() or _alive(reaper)) and time.monotonic() < deadline:  # (it exits after)
        time.sleep(0.05)
    assert not session.exists() and not _alive(reaper)
