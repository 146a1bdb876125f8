"""A full disk, a file-size limit or a read-only run directory: one paragraph, never "a bug".

:func:`probe_run_dir` runs at start-up, before the start-up checks and the warm start: it writes
(and fsyncs, and deletes) a 1 MiB file where the run directory will be, so a read-only or full
file system is found in a second, not after SFT and value pretraining. Once the learner is built,
:func:`check_room` compares the free space with what a checkpoint of it takes
(:func:`checkpoint_bytes`), so a disk too small for the first checkpoint is found before a step
is trained. A disk that fills mid-run (the journal, a checkpoint, published weights, the logs)
is caught where the run's writes are (:func:`disk_errno` reads the errno out of any wrapper,
safetensors' included): the temporaries of the failed write are removed and the run stops with
:class:`DiskFull` (exit 3), naming the path, the free space and the space needed; nothing up to
the last checkpoint and the journal is lost, and ``saorl train --resume`` continues once there is
room.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from saorl.atomic import errno_behind, write_probe
from saorl.errors import RunFailure, StartupError

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_TEXTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
          "File too large": errno.EFBIG, "Read-only file system": errno.EROFS}
"""Wrappers that keep only the text (safetensors' SafetensorError) are read by it."""


class DiskFull(RunFailure):
    """A write of the run failed for want of room or permission (exit 3); one paragraph."""


def disk_errno(error: BaseException) -> int | None:
    """The errno of a full disk, a file-size limit or a read-only file system behind ``error``
    (its causes and contexts included), or None when ``error`` is something else."""
    return errno_behind(error, (*NO_ROOM, errno.EROFS), _TEXTS)


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a directory would be created)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_ancestor(path)).free


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _reason(code: int | None) -> str:
    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "a file reached the file-size limit (ulimit -f)",
            errno.EROFS: "the file system is read-only"}.get(code, "it cannot be written")


def probe_run_dir(run_dir: Path) -> None:
    """:class:`~saorl.errors.StartupError` unless a 1 MiB file can be written, fsynced and deleted
    where ``run_dir`` is (or will be created)."""
    where = existing_ancestor(run_dir)
    probe = where / f".saorl-write-probe-{os.getpid()}.tmp"
    try:
        write_probe(probe)
    except OSError as e:
        free = free_bytes(where)
        code = e.errno if e.errno in NO_ROOM + READ_ONLY else None
        why = "it is not writable (permissions)" if code in (errno.EACCES, errno.EPERM) else _reason(code)
        raise StartupError(
            f"the run directory {run_dir} cannot be written: a 1 MiB test file in {where} failed "
            f"({e.strerror}): {why}; {mib(free)} free there. A run writes its journal, checkpoints "
            "(each about the size of the policy, the critic and their optimizer states) and logs there: "
            "give a --run-dir (or run.out_dir) on a writable disk with room.") from None


def checkpoint_bytes(learner) -> int:
    """About what one checkpoint of ``learner`` takes: the saved weights (a LoRA policy's adapter
    only) and two fp32 Adam moments per trained parameter, plus a tenth and 1 MiB."""
    total = 0
    for name in ("policy", "critic"):
        model = getattr(learner, name, None)
        if model is None or not hasattr(model, "parameters"):
            continue
        adapter_only = name == "policy" and getattr(learner, "lora", False)
        for p in model.parameters():
            if p.requires_grad:
                total += p.numel() * (p.element_size() + 8)
            elif not adapter_only:
                total += p.numel() * p.element_size()
    return total + total // 10 + 2**20  # and the manifest, the RNG state, the pending rollouts


def check_room(run_dir: Path, needed: int) -> None:
    """:class:`~saorl.errors.StartupError` when the disk of ``run_dir`` has less free space than
    one checkpoint (``needed`` bytes) takes."""
    free = free_bytes(run_dir)
    if needed > free:
        raise StartupError(
            f"the run directory {run_dir} has {mib(free)} free, but one checkpoint of this run takes about "
            f"{mib(needed)} (the policy, the critic and their optimizer states), and the run keeps "
            "run.keep_checkpoints of them plus the one being written: give a --run-dir (or run.out_dir) "
            "on a disk with room, or free space there.")


def disk_failure(error: BaseException, run_dir: Path, needed: int | None, removed: list[str]) -> DiskFull:
    """The paragraph for a write of the run in ``run_dir`` that ``error`` (:func:`disk_errno` is
    not None) stopped; ``removed``: the temporaries deleted since."""
    code = disk_errno(error)
    path = next((e.filename for e in _chain(error) if isinstance(e, OSError) and e.filename), None)
    what = f"cannot write {path}" if path else f"a write into {run_dir} failed"
    need = f"; the next checkpoint needs about {mib(needed)}" if needed else ""
    gone = f" The half-written files were removed ({', '.join(removed)})." if removed else ""
    return DiskFull(
        f"{what}: {_reason(code)} ({os.strerror(code) if code else error}); {mib(free_bytes(run_dir))} "
        f"free on the disk of {run_dir}{need}.{gone} Nothing up to the last checkpoint and the journal "
        f"is lost: free space (or make the file system writable) and continue with `saorl train --resume "
        f"{run_dir}`.")


def _chain(error: BaseException) -> list[BaseException]:
    out, e = [], error
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out
