"""What ``ps`` shows for saorl's helper processes: ``saorl: rollout worker 0 of run NAME``,
``saorl: reward host 3 of run NAME``, instead of ``python3 -c from multiprocessing.spawn ...``.

A run names itself once (:func:`name_run`, the run directory's name), in an environment variable
its helpers inherit; each helper sets its own title (:func:`set_title`) as it starts. The title is
the whole command line ``ps -eo args`` prints (the ``setproctitle`` package rewrites it) and the
kernel's 15-character process name (``ps -eo comm``, ``top``): ``saorl: rollout`` and the like.
Without ``setproctitle`` (an environment that lacks it) only the kernel's name is set
(``prctl(PR_SET_NAME)``). The title never grows past the process's original command line
(``SPT_NOENV``): the environment's memory, which ``/proc/PID/environ`` shows, is left as it was.
A title is a convenience: nothing here ever fails a process.
"""

from __future__ import annotations

import ctypes
import os

RUN_ENV = "SAORL_RUN_NAME"
"""The environment variable that carries the run's name to its helper processes."""
_PR_SET_NAME = 15


def name_run(name: str) -> None:
    """This process and every helper it starts from now on belong to the run ``name``."""
    os.environ[RUN_ENV] = name


def title(role: str) -> str:
    """``saorl: ROLE of run NAME`` (``saorl: ROLE`` outside a run)."""
    run = os.environ.get(RUN_ENV)
    return f"saorl: {role} of run {run}" if run else f"saorl: {role}"


def set_title(role: str) -> str:
    """Title this process (see the module docstring); the title."""
    text = title(role)
    # the title stays inside the original command line's memory: past it, setproctitle would
    # overwrite the environment's, which /proc/PID/environ reads, and a process forked from this
    # one would no longer show the mark that finds what user code detached (saorl.envs.escapees)
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        import setproctitle

        setproctitle.setproctitle(text)
        return text
    except ImportError:
        pass
    except Exception:  # pragma: no cover - a platform where it cannot
        return text
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text.encode()[:15]), 0, 0, 0)
    except Exception:  # pragma: no cover - not Linux
        pass
    return text
