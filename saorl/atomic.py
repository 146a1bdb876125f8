"""Atomic writes: every file and directory saorl replaces is replaced whole or not at all.

A file is written to a hidden temporary sibling (``.NAME.tmp-<pid>-<random>``), fsynced, then
``os.replace``d over the destination, and the directory is fsynced (:func:`atomic_file`,
:func:`write_text`, :func:`write_json`). A directory is built in a temporary sibling and renamed
into place; an existing one is first renamed aside, then deleted (:func:`atomic_dir`). A crash or
an exception midway leaves the previous file or directory intact and nothing half-written at the
destination; the temporaries are removed on exceptions (a hard kill can leave a hidden
temporary sibling, never a partial ``NAME``). A directory gets the permissions a plain
``mkdir`` would give it (:func:`readable_as_umask_allows`), not ``mkdtemp``'s 0700. Directory
fsyncs are best effort: not every filesystem allows them.

Used by the checkpoints, the published weights, the run directory's ``config.yaml``, the exported
models and every safetensors file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's is best effort)."""
    path = Path(path)
    is_dir = path.is_dir()
    flags = os.O_RDONLY | (os.O_DIRECTORY if is_dir and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if is_dir:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not is_dir:
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it replaces ``path`` (fsynced,
    then the directory); on an exception it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        readable_as_umask_allows(tmp)  # safetensors writes its files 0600
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) to ``path``, atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, obj: Any, **dump: Any) -> Path:
    """``obj`` as JSON to ``path``, atomically (``dump``: ``json.dumps`` options)."""
    return write_text(path, json.dumps(obj, **dump))


@contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``out_dir``; on success it replaces ``out_dir``.

    On an exception the temporary directory is deleted and ``out_dir`` is untouched.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        readable_as_umask_allows(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        fsync_path(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def umask() -> int:
    """The process's umask (read from ``/proc/self/status`` where there is one, so no other thread
    ever sees a changed umask)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_as_umask_allows(root: Path) -> None:
    """Give ``root`` and everything under it the permissions a plain ``mkdir`` and ``open`` would
    have (``0o777`` for a directory or an executable, else ``0o666``, less the umask) where they
    have fewer: ``tempfile.mkdtemp`` makes
    its directory 0700, and an exported model or cache must be readable by the group and others
    of a shared machine as ``save_pretrained`` into a plain directory leaves it. Never removes a
    permission."""
    mask = umask()
    for p in [root, *(root.rglob("*") if root.is_dir() else ())]:
        if p.is_symlink():
            continue
        mode = p.stat().st_mode & 0o7777
        want = (0o777 if p.is_dir() or mode & 0o100 else 0o666) & ~mask  # an executable stays one
        if mode | want != mode:
            os.chmod(p, mode | want)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is renamed aside first and deleted after."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{str(dst)!r} exists and is not a directory")
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    try:
        os.rename(src, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    fsync_path(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


PROBE_BYTES = 2**20
"""The size of :func:`write_probe`'s file: enough that a disk with no room refuses it."""


def write_probe(path: str | Path) -> None:
    """Write :data:`PROBE_BYTES` zero bytes to the file ``path``, fsync and delete it: ``OSError`` as
    the write failed (no room, read-only, not writable); the file never stays behind."""
    probe = Path(path)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # not created (a read-only file system refuses even the unlink)


def errno_behind(error: BaseException, codes: Collection[int], texts: Mapping[str, int]) -> int | None:
    """The first of ``codes`` an ``OSError`` carries in ``error`` or its causes and contexts, or the
    code of the first of ``texts`` found in one's message (wrappers that keep only the text, such as
    safetensors' SafetensorError); None when neither is there."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in codes:
            return e.errno
        for text, code in texts.items():
            if text in str(e):
                return code
        e = e.__cause__ or e.__context__
    return None
