"""A forced stop (a second Ctrl-C, or the stop past trainer.stop_timeout_s) ends the process at
once and leaves no semaphore for multiprocessing's resource tracker to warn about in the log."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import multiprocessing as mp
from saorl.runtime.stopping import StopControl

ctx = mp.get_context("spawn")
queues = [ctx.Queue() for _ in range(2)]  # as a local backend holds (results, one per worker)
queues[0].put("x")
StopControl(60.0, print, lambda: "nothing kept").force("a second Ctrl-C")
"""


def test_a_forced_stop_leaves_no_leaked_semaphore_warning():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 130, res.stderr
    assert "stopping at once: a second Ctrl-C" in res.stderr
    assert "leaked semaphore" not in res.stderr, res.stderr
