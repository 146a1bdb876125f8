"""A rollout worker never outlives its trainer, whatever killed the trainer (``kill -9`` included).

Two mechanisms, because neither covers everything alone, both in
:func:`~saorl.parent_death.die_with_parent` (which also ends the child processes that run
user code, :mod:`saorl.envs.hosted`):

- on Linux the worker asks the kernel for ``SIGKILL`` when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``). The kernel ties that signal to the parent *thread*, so it is
  asked for only when the worker was started from the trainer's main thread; a worker restarted
  by the feed thread (which ends before the trainer does) would otherwise die with that thread;
- on every system a watcher thread checks every :data:`PARENT_CHECK_S` seconds that the
  worker's parent is still the trainer that started it, and kills the worker otherwise.

Both start before anything heavy is imported: :func:`run_worker` is the process's entry point
and this module imports only the standard library (and ``parent_death``, which does too), and
the worker's spec arrives pickled, so unpickling the process arguments imports nothing of torch
or the models. With the worker gone,
the multiprocessing resource tracker it shared with the trainer sees its last pipe close and
exits too. (Sandbox processes of the worker's episodes run with ``bwrap --die-with-parent``.)

Processes the trainer does not start itself — the daemons of a private Ray cluster (raylet, GCS,
and the agents, which otherwise linger a minute after their raylet dies) — are covered by a
:class:`Reaper`: a small watchdog process told the pids (and start times, so a reused pid is
never hit) to ``SIGKILL`` and the directories to delete once the trainer is gone. It notices by
the end-of-file of a pipe only the trainer holds, so it acts however the trainer died; a trainer
that shuts its cluster down in order tells it to forget them first.

A reaper is in the trainer's process group, so ``kill -9`` of the whole group kills it too, and
nothing is left to delete the cluster's session directory. Such a directory carries its owner
(:func:`mark_owner`: this boot, the trainer's pid and start time), and the next trainer that
starts a private cluster removes every marked directory whose owner is gone, after killing any
process still running from it (:func:`remove_orphans`).
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

from saorl.parent_death import PARENT_CHECK_S, die_with_parent

__all__ = ["PARENT_CHECK_S", "Reaper", "descendants", "die_with_parent", "run_worker", "start_time"]

def run_worker(parent_pid: int, kernel_signal: bool, worker_id: int, spec: bytes, requests, results,
               pulse=None) -> None:
    """Entry point of a rollout worker process: first the lifeline, then
    :func:`saorl.runtime.backends.worker.worker_main` with the unpickled ``spec`` (and the
    :class:`~saorl.runtime.backends.watchdog.WorkerPulse` it writes its progress to)."""
    die_with_parent(parent_pid, kernel_signal)
    from saorl.proctitle import set_title
    from saorl.runtime.backends.worker import worker_main

    set_title(f"rollout worker {worker_id}")
    worker_main(worker_id, pickle.loads(spec), requests, results, pulse)


# --------------------------------------------------------------------------------- reaper
def start_time(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot, from ``/proc``), or None if it is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """The live descendants of ``root`` (children, their children, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


OWNER = ".saorl-owner"
"""The marker file of a directory that :func:`remove_orphans` may delete once its owner is gone."""


def _boot_id() -> str:
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return "-"


def mark_owner(directory: str) -> None:
    """Mark ``directory`` as this process's: deleted by :func:`remove_orphans` once it is gone."""
    with open(os.path.join(directory, OWNER), "w") as f:
        f.write(f"{_boot_id()} {os.getpid()} {start_time(os.getpid())}\n")


def _owner_alive(directory: str) -> bool:
    """Whether the owner :func:`mark_owner` wrote into ``directory`` still runs (True: unmarked,
    unreadable, or not this machine's kind of marker: left alone)."""
    try:
        boot, pid, start = open(os.path.join(directory, OWNER)).read().split()
    except (OSError, ValueError):
        return True
    return boot == _boot_id() and start_time(int(pid)) == start


def _users(directory: str) -> list[int]:
    """Processes whose command line names ``directory`` (a Ray daemon's options name its session)."""
    named = re.compile(re.escape(directory).encode() + rb"(/|\x00|$)")
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if named.search(cmd):
                out.append(int(d))
    return out


def remove_orphans(pattern: str) -> list[str]:
    """Delete the directories matching ``pattern`` that :func:`mark_owner` marked and whose owner
    is gone (a process still running from one is killed first); return them."""
    removed = []
    for d in glob.glob(pattern):
        if not os.path.isdir(d) or _owner_alive(d):
            continue
        if sys.platform.startswith("linux"):
            for pid in _users(d):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


class Reaper:
    """A watchdog process that kills the processes (and deletes the directories) it is told about
    once this process is gone (see the module docstring). Linux only (``/proc``)."""

    def __init__(self) -> None:
        r, self._w = os.pipe()  # not inheritable: only this process holds the write end
        # a session of its own: `kill -9 -PGID` of the trainer's job must not take the reaper along
        self._proc = subprocess.Popen([sys.executable, "-m", "saorl.runtime.backends.lifeline", str(r)],
                                      pass_fds=(r,), stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(r)

    def _send(self, line: str) -> None:
        if self._w is not None:
            os.write(self._w, f"{line}\n".encode())

    def watch(self, pids: list[int]) -> None:
        for pid in pids:
            if (start := start_time(pid)) is not None:
                self._send(f"pid {pid} {start}")

    def remove_dir(self, path: str) -> None:
        self._send(f"rmtree {path}")

    def close(self) -> None:
        """Forget everything (the caller stopped them in order) and end the watchdog."""
        if self._w is not None:
            self._send("clear")
            os.close(self._w)
            self._w = None
            self._proc.wait(timeout=10)


def _reap(fd: int) -> None:
    """The watchdog: read orders until end-of-file, then kill and delete what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the trainer's to handle;
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # this process acts when the trainer is gone
    pids: dict[int, str] = {}
    dirs: list[str] = []
    with os.fdopen(fd, "r") as orders:
        for line in orders:
            what, _, arg = line.rstrip("\n").partition(" ")
            if what == "pid":
                pid, start = arg.split()
                pids[int(pid)] = start
            elif what == "rmtree":
                dirs.append(arg)
            elif what == "clear":
                pids.clear()
                dirs.clear()
    pids.pop(os.getpid(), None)
    for pid, start in pids.items():
        if start_time(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if dirs:
        time.sleep(0.2)  # the killed processes close their files
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    _reap(int(sys.argv[1]))
