"""saorl's model cache as a place on disk: where it is, whether it can take a model, who is
writing into it, and what killed writers left behind.

``<cache>`` is ``$SAORL_CACHE``, else ``$XDG_CACHE_HOME/saorl``, else ``~/.cache/saorl``; models
live in ``<cache>/models/<entry>``. Every failure to use it is :class:`CacheUnusable`, one
paragraph that names the cache (and ``SAORL_CACHE``), the free space there and the fix: a cache
that is a file, read-only, not writable, or without room for the model. :func:`check_writable`
finds these before a conversion starts (a 1 MiB probe written, fsynced and deleted, and the free
space compared with what the model will take); :func:`cache_failure` names them when a write
fails midway (a disk filling while the model is written).

An entry is written by one process at a time, under ``<cache>/models/.<entry>.lock``
(:class:`EntryLock`, an ``flock``): the holder writes its pid and host into the lock file, and a
process that has to wait says for whom, every :data:`WAIT_SAY_EVERY_S` seconds. A writer's
temporaries are hidden siblings named ``.<entry>.tmp-<pid>-*`` / ``.<entry>.download-<pid>-*``
(:func:`new_temp`). A ``kill -9`` leaves them behind; :func:`remove_leftovers`, run by every
conversion, removes those whose entry's lock nobody holds (so no conversion of that entry runs
in any process that shares the cache), never a live conversion's. Every temporary is made under
its entry's lock and a killed holder's ``flock`` is released, so the lock alone decides: the pid in
the name is not consulted (over NFS or from another container's pid namespace a live writer's pid
looks dead here).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from saorl.atomic import errno_behind, write_probe
from saorl.errors import StartupError

CACHE_ENV = "SAORL_CACHE"
WAIT_SAY_EVERY_S = 30.0
"""How often a process waiting for another's conversion of the same model says so."""
LEFTOVER = re.compile(r"^\.(?P<entry>.+)\.(?:tmp|download|old)-(?:(?P<pid>\d+)-)?[^/]*$")
"""A writer's temporary in ``<cache>/models`` (the pid is absent in those of saorl before 0.1.1)."""
_NO_ROOM = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "a file reached the file-size limit (ulimit -f)"}
_NOT_WRITABLE = {errno.EROFS: "it is on a read-only file system",
                 errno.EACCES: "this user may not write there (permissions)",
                 errno.EPERM: "this user may not write there (permissions)",
                 errno.ENOTDIR: "a file stands where a directory should be",
                 errno.EEXIST: "a file stands where a directory should be"}
_TEXTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
          "File too large": errno.EFBIG, "Read-only file system": errno.EROFS,
          "Permission denied": errno.EACCES}
"""Wrappers that keep only the text (safetensors' SafetensorError) are read by it."""


class ModelSourceError(FileNotFoundError, StartupError):
    """A model or tokenizer source that cannot be made into a local model directory (one paragraph
    saying what to do; the command line reports it with exit status 2)."""


class CacheUnusable(ModelSourceError):
    """saorl's model cache cannot take a model: a file, read-only, not writable, or full."""


def cache_root() -> Path:
    """saorl's user-level cache: ``$SAORL_CACHE``, ``$XDG_CACHE_HOME/saorl`` or ``~/.cache/saorl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "saorl"


def models_dir() -> Path:
    return cache_root() / "models"


def say(msg: str) -> None:
    print(f"saorl: {msg}", file=sys.stderr, flush=True)


def describe_cache() -> str:
    """``the model cache PATH (SAORL_CACHE=PATH)``, or how the path was chosen when it is unset."""
    root = cache_root()
    how = f"{CACHE_ENV}={os.environ[CACHE_ENV]}" if os.environ.get(CACHE_ENV) else f"{CACHE_ENV} unset"
    return f"saorl's model cache {root} ({how})"


def free_text(path: Path) -> str:
    """The free space on the disk of ``path`` (its nearest existing ancestor) as ``N MB free``."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f"{shutil.disk_usage(p).free / 1e6:,.0f} MB free there"
    except OSError:
        return "its free space unknown"


def failure_errno(error: BaseException) -> int | None:
    """The errno of a cache write that failed for want of room or permission (causes and contexts
    of ``error`` included, and wrappers that keep only the text), or None."""
    return errno_behind(error, {*_NO_ROOM, *_NOT_WRITABLE}, _TEXTS)


def cache_failure(code: int | None, label: str, need: str = "", detail: str = "") -> CacheUnusable:
    """The paragraph for the cache failing with ``code``; ``label`` (``model.policy=NAME``) starts it."""
    root = cache_root()
    if need:
        why = f"not enough room: {need}"
    elif code in _NO_ROOM:
        why = f"{_NO_ROOM[code]} (nothing half-written was kept)"
    elif code in (errno.ENOTDIR, errno.EEXIST) or (root.exists() and not root.is_dir()):
        why = f"{_file_on_the_way(root)} is a file, not a directory"
    else:
        why = f"it cannot be written: {_NOT_WRITABLE.get(code, 'the write failed')}"
    said = f" ({detail})" if detail else ""
    return CacheUnusable(
        f"{label}: {describe_cache()} cannot take the converted model: {why}{said}; "
        f"{free_text(root)}. saorl converts a GGUF file or a short model name once into that cache: "
        f"point {CACHE_ENV} at a writable directory on a disk with room (it is created if missing), "
        "or free space there, and run again.")


def _file_on_the_way(root: Path) -> Path:
    for p in [root, *root.parents]:
        if p.exists():
            return p
    return root


def check_writable(label: str, need_bytes: int) -> None:
    """:class:`CacheUnusable` unless ``<cache>/models`` is (or can be made) a directory where a
    1 MiB file can be written, fsynced and deleted, on a disk with ``need_bytes`` free."""
    models = models_dir()
    top = _file_on_the_way(models)
    if not top.is_dir():
        raise cache_failure(errno.ENOTDIR, label)
    probe = models / f".write-probe-{os.getpid()}.tmp"
    try:
        models.mkdir(parents=True, exist_ok=True)
        write_probe(probe)
    except OSError as e:
        raise cache_failure(e.errno, label,
                            detail=f"writing a 1 MiB test file failed: {e.strerror}") from None
    free = shutil.disk_usage(models).free
    if free < need_bytes:
        raise cache_failure(errno.ENOSPC, label, need=f"the converted model needs about "
                            f"{need_bytes / 1e6:,.0f} MB") from None


def new_temp(out: Path, kind: str = "tmp") -> Path:
    """A fresh hidden sibling of ``out`` to build it in, named with this process's pid."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}-", dir=out.parent))


class EntryLock:
    """An exclusive ``flock`` on ``<cache>/models/.<entry>.lock``: one writer per entry. A process
    that must wait says so, and for whom (the pid and host written into the lock file by its
    holder), at once and every :data:`WAIT_SAY_EVERY_S` seconds."""

    def __init__(self, out: Path, label: str):
        self.out, self.label = out, label
        self.path = out.parent / f".{out.name}.lock"

    def __enter__(self) -> EntryLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(self.path, "a+")
        except OSError as e:
            raise cache_failure(e.errno, self.label,
                                detail=f"cannot create {self.path.name}: {e.strerror}") from None
        t0, said = time.monotonic(), None
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if said is None or now - said >= WAIT_SAY_EVERY_S:
                    waited = f" ({now - t0:.0f} s so far)" if said is not None else ""
                    say(f"{self.label}: waiting for {self._holder()}, which is writing {self.out.name} into "
                        f"the model cache {self.out.parent}{waited}; this process goes on once it is done")
                    said = now
                time.sleep(0.2)
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"{os.getpid()} {socket.gethostname()}\n")
        self.f.flush()
        return self

    def _holder(self) -> str:
        try:
            pid, _, host = self.path.read_text().strip().partition(" ")
        except OSError:
            return "another process"
        if not pid.isdigit():
            return "another process"
        return f"process {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")

    def __exit__(self, *exc) -> bool:
        self.f.close()
        return False


def remove_leftovers(holding: Path | None = None) -> list[str]:
    """Remove what killed writers left in ``<cache>/models`` (module docstring); ``holding``: the
    entry whose lock this process holds. The names removed."""
    models = models_dir()
    try:
        names = sorted(os.listdir(models))
    except OSError:
        return []
    removed = []
    for name in names:
        m = LEFTOVER.match(name)
        if m is None:
            continue
        ours = holding is not None and m["entry"] == holding.name
        if ours or _unlocked(models, m["entry"]):  # never by pid: module docstring
            shutil.rmtree(models / name, ignore_errors=True)
            if not (models / name).exists():
                removed.append(name)
    memos = models / ".hashes"
    for f in memos.glob(".*.tmp-*") if memos.is_dir() else ():
        pid = f.name.rpartition(".tmp-")[2].split("-")[0]
        if pid.isdigit() and _dead(int(pid)):
            f.unlink(missing_ok=True)
            removed.append(f".hashes/{f.name}")
    return removed


def _dead(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


def _unlocked(models: Path, entry: str) -> bool:
    """Whether no process holds ``entry``'s lock now (a missing lock file: nobody ever took it)."""
    path = models / f".{entry}.lock"
    try:
        f = open(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
