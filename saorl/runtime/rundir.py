"""The run directory as a whole: who may write into it, what a crash left behind, and the two
errors a run directory can stop a run with.

A run directory belongs to one run. :func:`check_run_dir` runs first (before the start-up checks
and the warm start), :func:`claim_run_dir` checks again and creates and locks the directory:

- a **fresh** run needs a directory that is new or empty (a lone ``.lock``, left by a start killed
  with ``kill -9`` before it wrote anything, counts as empty). Training into an old run's directory
  would mix the two runs' logs, journals, checkpoints and weights (and prune the old run's
  files); that is refused with :class:`RunDirError`, pointing at ``--resume``;
- a **resumed** run needs the directory to hold a run (its ``config.yaml``);
- either way the directory is locked (``fcntl.flock`` on ``RUN/.lock``) for as long as the run
  lives, so a second trainer in the same directory (a resume while the run still runs) is
  refused instead of interleaving with the first; ``saorl train`` asks first
  (:func:`check_not_in_use`), before the seconds of importing the trainer. The kernel releases
  the lock when the process dies, ``kill -9`` included, so a crash never leaves a stale lock;
- then the run deletes the temporaries a crash left behind (:func:`remove_temporaries`:
  ``checkpoints/.tmp-step-*``, the hidden ``.NAME.tmp-*`` and ``.NAME.old-*`` of atomic writes,
  ``*.tmp``): nothing ever reads them, since every file is renamed into place only once complete.

:class:`CorruptionError` is raised on resume when a file the run needs (a journal line, a
checkpoint's manifest or tensors, ``checkpoints/latest``) is damaged or missing; its message
is one paragraph naming the file and the choices (see :mod:`saorl.runtime.checkpoint`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from datetime import datetime
from pathlib import Path

from saorl.errors import RunFailure, StartupError
from saorl.run_paths import RunPaths


class RunDirError(StartupError):
    """The run directory cannot be used as asked (a user error, exit 2); one paragraph."""


class CorruptionError(RunFailure):
    """A file a resume needs is damaged or missing (exit 3); the message names it and the choices."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_temporary(name: str) -> bool:
    """Whether ``name`` is an atomic write's temporary (``.tmp-*``, ``.X.tmp-*``, ``.X.old-*``, ``*.tmp``)."""
    return (name.startswith(".") and (".tmp" in name or ".old-" in name)) or name.endswith(".tmp")


class RunDirLock:
    """An exclusive ``flock`` on ``RUN/.lock``, held until :meth:`release` (or process death)."""

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        self.path = RunPaths(run_dir).lock
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise _in_use(run_dir) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _in_use(run_dir: Path) -> RunDirError:
    return RunDirError(
        f"{run_dir} is in use by another saorl process (it holds {RunPaths(run_dir).lock}): two trainers "
        "in one run directory would overwrite each other's journal, checkpoints and weights. "
        "Wait for that run to end (or stop it), then resume with `saorl train --resume "
        f"{run_dir}`; to start a new run, give another --run-dir.")


def check_not_in_use(run_dir: Path) -> None:
    """:class:`RunDirError` now if another process holds ``run_dir``'s lock: ``saorl train
    --resume`` asks this before it imports the trainer (seconds), and takes the lock later
    (:func:`claim_run_dir`). Writes nothing."""
    import fcntl

    try:
        fd = os.open(RunPaths(run_dir).lock, os.O_RDONLY)
    except OSError:
        return  # no lock file: never claimed, or not a run directory (claim_run_dir says so)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with the holder's exclusive lock
    except OSError:
        raise _in_use(run_dir) from None
    finally:
        os.close(fd)


def remove_temporaries(run_dir: Path) -> list[str]:
    """Delete the temporaries a crash left in ``run_dir``; return their paths (relative)."""
    removed = []
    for d in RunPaths(run_dir).write_dirs:
        if not d.is_dir():
            continue
        for p in d.iterdir():
            if not is_temporary(p.name):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(str(p.relative_to(run_dir)))
    return sorted(removed)


def check_run_dir(run_dir: Path, *, resume: bool) -> None:
    """:class:`RunDirError` (one paragraph) unless ``run_dir`` suits a fresh (``resume=False``:
    new or empty) or a resumed run (it holds a run's ``config.yaml``)."""
    if resume:
        if not RunPaths(run_dir).config.is_file():
            raise RunDirError(f"cannot resume {run_dir}: it has no config.yaml, so it is not a saorl run "
                              "directory (or its config was deleted). Give the directory `saorl train` "
                              "created, or start a new run without --resume.")
    elif run_dir.exists():
        if not run_dir.is_dir():
            raise RunDirError(f"--run-dir {run_dir} exists and is not a directory; give a new or empty "
                              "directory.")
        # a lone .lock: a start killed (kill -9) before it wrote anything; a live holder is refused
        # when the directory is claimed
        entries = sorted(p.name for p in run_dir.iterdir() if p.name != RunPaths(run_dir).lock.name)
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise RunDirError(
                f"--run-dir {run_dir} is not empty ({shown}): a new run there would mix its journal, "
                "checkpoints, weights and logs with what is already there. To continue the run in it, "
                f"use `saorl train --resume {run_dir}` (overrides such as trainer.steps=N may follow); "
                "to start a new run, give a new or empty --run-dir (or none: run.out_dir/NAME-TIMESTAMP).")


def claim_run_dir(run_dir: Path, *, resume: bool) -> RunDirLock:
    """:func:`check_run_dir`, then create and lock ``run_dir``; return the lock (release it when
    the run ends). The run removes a crash's temporaries (:func:`remove_temporaries`) once it
    holds the lock."""
    check_run_dir(run_dir, resume=resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunDirLock(run_dir)


def new_run_dir(cfg) -> Path:
    """A fresh ``run.out_dir/<run.name>-<timestamp>`` path (a suffix when that exists already), not
    created yet: :func:`saorl.training.train` creates it once the run's parts are built."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    d = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    n = 1
    while d.exists():
        d = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}-{n}"
        n += 1
    return d
