"""Processes that user code started and detached: found by a mark in their environment, killed.

A reward function that forks, calls ``setsid`` and forks again leaves a process outside the process
group :func:`~saorl.envs.sandbox.kill_group` kills, re-parented to init: nothing the run killed
reaches it, and it outlives the run. What it cannot leave is the environment it inherited. So
every child that runs user code (:class:`~saorl.envs.hosted.HostPool`) is started with
``SAORL_USER_CODE=<run>/<pool>/<child>`` in its environment, which every process it starts inherits
(``fork`` copies it, ``exec`` keeps it unless the caller hands a new one), and :func:`kill_marked`
SIGKILLs every process whose environment (``/proc/PID/environ``, as it was at its ``exec``) carries
a mark under a prefix: one child's on its deadline, one pool's when it closes, and the whole run's
when ``saorl train`` ends (:func:`kill_run_escapees`), which reaches the children of workers that
died without closing their pools. ``<run>`` is ``SAORL_RUN_MARK``, set by the trainer and inherited
by its workers (a process outside a run uses its own pid).

What this does not reach: a process that ``exec``s with an environment of its own making
(``env -i``), or one in another PID namespace. Linux only (``/proc``); elsewhere a no-op.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MARK = "SAORL_USER_CODE"
RUN_MARK = "SAORL_RUN_MARK"


def run_mark() -> str:
    """This run's mark (``SAORL_RUN_MARK``, set here if the process has none)."""
    return os.environ.setdefault(RUN_MARK, f"r{os.getpid()}-{time.time_ns()}")


def new_run_mark() -> str:
    """A fresh mark for the run this process starts now, replacing any it inherited: a run started by
    another saorl process (an experiment's arms, a test) must not share that process's mark, or its
    end would kill what the other runs' user code started."""
    os.environ[RUN_MARK] = f"r{os.getpid()}-{time.time_ns()}"
    return os.environ[RUN_MARK]


def marked(prefix: str) -> list[int]:
    """Pids (not this process's) whose environment has ``SAORL_USER_CODE`` equal to ``prefix`` or
    under ``prefix/``."""
    want, under = f"{MARK}={prefix}".encode(), f"{MARK}={prefix}/".encode()
    me, out = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if any(v == want or v.startswith(under) for v in env.split(b"\0")):
            out.append(int(name))
    return out


def kill_marked(prefix: str, passes: int = 20) -> int:
    """SIGKILL every process :func:`marked` finds, again until none is left (one that forked
    meanwhile); how many were killed. A killed process stays listed until its parent reaps it
    (a zombie's environ reads empty, so it is not)."""
    killed: set[int] = set()
    for _ in range(passes):
        pids = [p for p in marked(prefix) if p not in killed or _alive(p)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return len(killed)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_run_escapees() -> int:
    """Kill what the user code of this run left running (see the module docstring)."""
    mark = os.environ.get(RUN_MARK)
    return kill_marked(mark) if mark else 0
