"""``bfcl-eval`` for the test suite: the real package from the index, installed without its
dependencies (as saorl's users install it: ``pip install --no-deps bfcl-eval==2026.3.23``) into a
cache directory, ``$SAORL_BFCL_SITE`` or ``~/.cache/saorl/bfcl-eval-<version>``, once (a 2 MB wheel,
a few seconds), under a file lock, in a temporary sibling renamed into place. The directory is put
on ``sys.path`` and on ``PYTHONPATH`` (for the ``saorl`` subprocesses a test starts).

A package that is importable already (installed into the environment) is used as it is.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "bfcl-eval==2026.3.23"


class Unavailable(RuntimeError):
    """The package cannot be installed here; the message says why."""


def site_dir() -> Path:
    if os.environ.get("SAORL_BFCL_SITE"):
        return Path(os.environ["SAORL_BFCL_SITE"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "saorl" / f"bfcl-eval-{PACKAGE.split('==')[1]}"


def _install(site: Path) -> None:
    site.parent.mkdir(parents=True, exist_ok=True)
    with open(site.parent / f".{site.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (site / ".complete").is_file():
            return
        tmp = site.with_name(f".{site.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), PACKAGE]
            out = subprocess.run(pip, capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-6:])
                raise Unavailable(f"pip install --no-deps {PACKAGE} failed (exit {out.returncode}):\n{tail}")
            (tmp / ".complete").write_text(PACKAGE + "\n")
            shutil.rmtree(site, ignore_errors=True)
            os.rename(tmp, site)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip install --no-deps {PACKAGE} took over 300 s") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def ensure() -> None:
    """``bfcl_eval`` importable here and in subprocesses (module docstring); :class:`Unavailable`."""
    try:
        importlib.import_module("bfcl_eval")
        return
    except ImportError:
        pass
    site = site_dir()
    if not (site / ".complete").is_file():
        _install(site)
    sys.path.insert(0, str(site))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(site)])
    importlib.invalidate_caches()
    importlib.import_module("bfcl_eval")
