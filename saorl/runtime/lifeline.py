"""A rollout worker never outlives its trainer, whatever killed the trainer (``kill -9`` included).

Two mechanisms, because neither covers everything alone:

- on Linux the worker asks the kernel for ``SIGKILL`` when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``). The kernel ties that signal to the parent *thread*, so it is
  asked for only when the worker was started from the trainer's main thread; a worker restarted
  by the feed thread (which ends before the trainer does) would otherwise die with that thread;
- on every system a watcher thread checks every :data:`PARENT_CHECK_S` seconds that the
  worker's parent is still the trainer that started it, and kills the worker otherwise.

Both start before anything heavy is imported: :func:`run_worker` is the process's entry point
and this module imports only the standard library, and the worker's spec arrives pickled, so
unpickling the process arguments imports nothing of torch or the models. With the worker gone,
the multiprocessing resource tracker it shared with the trainer sees its last pipe close and
exits too. (Sandbox processes of the worker's episodes run with ``bwrap --die-with-parent``.)
"""

from __future__ import annotations

import os
import pickle
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
        os.kill(os.getpid(), signal.SIGKILL)  # no trainer is left to take the results

    if os.getppid() != parent_pid:  # the parent died before any of this was in place
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="saorl-parent-watch", daemon=True).start()


def run_worker(parent_pid: int, kernel_signal: bool, worker_id: int, spec: bytes, requests, results) -> None:
    """Entry point of a rollout worker process: first the lifeline, then
    :func:`saorl.runtime.worker.worker_main` with the unpickled ``spec``."""
    die_with_parent(parent_pid, kernel_signal)
    from saorl.runtime.worker import worker_main

    worker_main(worker_id, pickle.loads(spec), requests, results)
