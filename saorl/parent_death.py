"""A process that dies with its parent, whatever killed the parent and whatever this process is doing.

:func:`die_with_parent` is the first thing a rollout worker (:mod:`saorl.runtime.backends.lifeline`) and a
child running user code (:mod:`saorl.envs.hosted_child`) do. Two mechanisms, because neither
covers everything alone:

- on Linux the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): it ends the
  process even when it is stuck in a C call that holds the GIL. The kernel ties it to the parent
  *thread* that started the process, so it is asked for only when that thread lives as long as the
  parent (the trainer's main thread; a pool's own thread); else it would fire when that thread ends;
- on every system a watcher thread that checks every :data:`PARENT_CHECK_S` seconds that the
  parent is still the process that started this one, and kills this one otherwise.

Standard library only: it runs before anything heavy is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PARENT_CHECK_S = 0.5
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, kernel_signal: bool) -> None:
    """Make this process die when ``parent_pid`` does (see the module docstring)."""
    if kernel_signal and sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watcher below still covers it

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGKILL)  # no parent is left to take the results

    if os.getppid() != parent_pid:  # the parent died before any of this was in place
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="saorl-parent-watch", daemon=True).start()
