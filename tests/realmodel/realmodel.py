"""Helpers of the real-model tests: the model's short name and a ``saorl`` command runner."""

import os
import subprocess
import sys
import time
from pathlib import Path

NAME = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parents[2]


def saorl(*args: str, cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess:
    """``python -m saorl.cli ARGS`` in ``cwd`` (this checkout's saorl), output captured."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "saorl.cli", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    print(f"\n[realmodel] saorl {' '.join(args[:2])} ...: exit {out.returncode} in "
          f"{time.monotonic() - t0:.0f}s", flush=True)
    return out
