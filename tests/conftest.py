import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Two cores on CI; keep torch from oversubscribing when tests spawn processes (and, under
# pytest-xdist, when another worker runs beside this one).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

_WHOLE_DIRS = ("vllm", "realmodel")
"""Test folders that run whole on one pytest-xdist worker each: they share session fixtures that
are costly to make twice (a vLLM server, a converted real model) and a test needs several GB."""

_VLLM_PREP: subprocess.Popen | None = None
"""The background making of the vLLM environment (:func:`pytest_collection_finish`), if started."""


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(items):
    """Under ``pytest -n N`` (the README's test command: pytest-xdist, ``--dist loadgroup``),
    tests/vllm and tests/realmodel each run whole on one worker, so their servers and converted
    model are made once and two of their multi-GB tests never run at once; xdist starts the largest
    groups first. Every other test goes to whichever worker is free."""
    root = Path(__file__).parent
    for item in items:
        top = Path(str(item.fspath)).relative_to(root).parts[0]
        if top in _WHOLE_DIRS and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(top))


def pytest_collection_finish(session):
    """When a collected test needs the real vLLM (the ``vllm_python`` fixture) and its environment is
    not made yet, start making it now, in the background (``python tests/vllm/server.py``, its own
    session): the ~2-3 min install overlaps the tests that run first, and the fixture, which takes
    the same file lock, waits for it. ``SAORL_VLLM=off`` or ``SAORL_VLLM_PREFETCH=0``: not started."""
    global _VLLM_PREP
    off = ("off", "0", "false")
    if (os.environ.get("SAORL_VLLM", "").lower() in off or os.environ.get("SAORL_VLLM_PREFETCH", "") in off
            or session.config.option.collectonly
            or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0"):  # one worker starts it
        return
    if not any("vllm_python" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    here = Path(__file__).parent / "vllm"
    sys.path.insert(0, str(here))
    from server import venv_dir

    if (venv_dir() / ".complete").is_file():
        return
    log = open(Path(tempfile.gettempdir()) / f"saorl-vllm-venv-{os.getpid()}.log", "w")
    _VLLM_PREP = subprocess.Popen([sys.executable, str(here / "server.py")], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    log.close()


def pytest_sessionfinish(session):
    """A background making of the vLLM environment still running is interrupted (its temporary
    directory removed by its own cleanup), not left behind."""
    if _VLLM_PREP is None or _VLLM_PREP.poll() is not None:
        return
    try:
        os.killpg(_VLLM_PREP.pid, signal.SIGINT)
        _VLLM_PREP.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(_VLLM_PREP.pid, signal.SIGKILL)
        _VLLM_PREP.wait()
    except ProcessLookupError:
        pass
