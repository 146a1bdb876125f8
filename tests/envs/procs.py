"""Process checks shared by the hosted-env tests."""

from __future__ import annotations

import os


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
