"""Run checkpoints: written atomically, verified before they are loaded, never loaded damaged.

``RUN/checkpoints/step-00000050/`` holds the learner's state, ``rng.safetensors`` (torch RNG
state), ``pending.jsonl`` (trajectories finished but not yet trained, one checksummed journal
line each) and ``manifest.json`` (step, policy version, optimizer hyper-parameters, Python RNG
state, the finished-rollout ranges, the journal segment the checkpoint continues from, counters,
the SHA-256 of every other file (by relative path, a sharded learner's shards included), and
``checksum``: the SHA-256 of the manifest's own canonical JSON without that member).
Everything is written into a temporary directory that is renamed into place at the end;
``RUN/checkpoints/latest`` (a file holding the directory name) is then replaced atomically.

**Resume** (:func:`resume_checkpoint`) loads the checkpoint ``latest`` names only after checking
all of it: ``latest`` names a directory that exists, the manifest parses and matches its
checksum, every file matches its hash (a flipped byte in a tensor file is found), and the
journal segments it continues from are all there. When any of that fails, the problem is one
paragraph naming the file, and then either (``run.resume_fallback``, the default) the newest
intact earlier checkpoint is used — the damaged directory is renamed ``damaged-step-N`` (kept
for inspection, never loaded or pruned), ``latest`` is pointed at the one used, and the steps
after it are redone from the journal, which is kept back to the oldest kept checkpoint for
exactly this — or the run stops with :class:`~saorl.runtime.rundir.CorruptionError`. With no
intact checkpoint it always stops. A run directory with no checkpoint at all resumes from step 0,
redoing the steps on record from the journal, only when the journal can
(:func:`restart_problem`): it shows no checkpoint was ever written (segment 0 is still there) and
it holds every rollout ``trained.jsonl`` records as trained; and when ``trained.jsonl``,
``metrics.jsonl`` (step rows) or the published weights (``weights/``) show training but the journal
is empty, the checkpoints and the journal were deleted. Each of these stops the resume with a
:class:`~saorl.runtime.rundir.CorruptionError` naming what was found, unless the user asks for
the restart from step 0 explicitly (``saorl train --resume RUN --restart``: ``restart=True``).

The learner writes its own state (``learner.save_state(directory)``, read back by
``learner.load_state``); its counters (policy version, steps, non-finite skips, running-mean
baseline: :class:`~saorl.runtime.learner.step_record.LearnerCounters`) go into the manifest. The
single-process layout (:func:`save_learner_files`): ``policy.safetensors``,
``critic.safetensors`` (state dicts in the models' own names) and ``optim.safetensors`` (both
optimizers' tensors, flattened by parameter index). The sharded learner writes either the same
layout (gathered to rank 0) or its ranks' shards
(:mod:`saorl.runtime.learner.sharded`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from saorl.atomic import atomic_dir, write_text
from saorl.data.trajectory import Trajectory
from saorl.models.serialize import load_safetensors, save_safetensors_atomic
from saorl.run_paths import RunPaths
from saorl.runtime.journal import Journal, decode_entry, write_entries
from saorl.runtime.rundir import CorruptionError, sha256_file

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d{8})")
REQUIRED = ("step", "version", "finished", "journal_segment", "files", "python_rng")


def _manifest_checksum(manifest: dict[str, Any]) -> str:
    import hashlib

    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_checkpoint(ckpt_root: Path, step: int, learner, extra: dict[str, Any],
                    pending: list[Trajectory], keep: int = 2) -> Path:
    name = f"step-{step:08d}"
    # written into a temporary sibling, fsynced and renamed into place; on an error (a full disk)
    # the half-written copy is removed, never left on the disk
    with atomic_dir(ckpt_root / name) as tmp:
        _write(tmp, step, learner, extra, pending)
    final = ckpt_root / name
    _point_latest(ckpt_root, name)
    _prune(ckpt_root, keep)
    return final


def _write(tmp: Path, step: int, learner, extra: dict[str, Any],
           pending: list[Trajectory]) -> None:
    learner_meta = learner.save_state(tmp)
    save_safetensors_atomic({"torch": torch.get_rng_state()}, tmp / "rng.safetensors")
    with open(tmp / "pending.jsonl", "w", encoding="utf-8") as f:
        write_entries(f, pending)
    manifest = {
        "step": step, **learner.counters.state(),
        **learner_meta, "python_rng": _py_rng_to_json(random.getstate()), **extra,
        "files": {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*"))
                  if p.is_file()},
    }
    manifest["checksum"] = _manifest_checksum(manifest)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)


def _point_latest(ckpt_root: Path, name: str) -> None:
    write_text(ckpt_root / LATEST, name)


def checkpoint_dirs(ckpt_root: Path) -> list[Path]:
    """The ``step-NNNNNNNN`` directories, oldest first (not temporaries, not damaged ones)."""
    if not ckpt_root.is_dir():
        return []
    return sorted(d for d in ckpt_root.iterdir() if _STEP_DIR.fullmatch(d.name) and d.is_dir())


def _prune(ckpt_root: Path, keep: int) -> None:
    for d in checkpoint_dirs(ckpt_root)[: -max(1, keep)]:
        shutil.rmtree(d, ignore_errors=True)


def _journal_segments(ckpt_root: Path) -> list[int]:
    """The journal segments the checkpoints' manifests name (unreadable ones are skipped: a
    damaged checkpoint is found, and reported, on resume)."""
    segs = []
    for d in checkpoint_dirs(ckpt_root):
        try:
            segs.append(int(json.loads((d / MANIFEST).read_text())["journal_segment"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return segs


def oldest_journal_segment(ckpt_root: Path) -> int | None:
    """The journal segment the oldest kept checkpoint continues from: the journal is pruned
    only before it, so any kept checkpoint can be resumed from (``None``: no readable one)."""
    return min(_journal_segments(ckpt_root), default=None)


def _py_rng_to_json(state) -> list:
    return [state[0], list(state[1]), state[2]]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The directory ``latest`` names, if it has a manifest (not verified: see :func:`verify`)."""
    pointer = ckpt_root / LATEST
    if not pointer.exists():
        return None
    d = ckpt_root / pointer.read_text().strip()
    return d if (d / MANIFEST).exists() else None


# ---------------------------------------------------------------------------------- verify
class StraySegmentError(CorruptionError):
    """A journal segment past a gap that no checkpoint names: a fault of the journal directory,
    the same whichever checkpoint is tried, so a resume stops on it rather than falling back."""


def verify(ckpt_dir: Path, journal: Journal, newest_segment: int = 0) -> dict[str, Any]:
    """The manifest of ``ckpt_dir`` after checking everything a resume from it reads (see the
    module docstring): the journal segments from its own up to ``newest_segment`` or the newest
    there; :class:`CorruptionError` naming the first damaged or missing file."""
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CorruptionError(f"{path} is missing")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptionError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or "checksum" not in manifest:
        raise CorruptionError(f"{path} is not a checkpoint manifest (no checksum)")
    if _manifest_checksum(manifest) != manifest["checksum"]:
        raise CorruptionError(f"{path} does not match its checksum (its content was changed)")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise CorruptionError(f"{path} lacks {', '.join(missing)}")
    for name, digest in manifest["files"].items():
        f = ckpt_dir / name
        if not f.is_file():
            raise CorruptionError(f"{f} is missing")
        if sha256_file(f) != digest:
            raise CorruptionError(f"{f} does not match the SHA-256 in its manifest (its bytes were changed "
                                  "or cut short)")
    own = int(manifest["journal_segment"])
    gone = journal.first_missing(own, newest_segment)
    if gone is not None:
        later = journal.next_present(gone)
        if later is not None and int(gone.stem[4:]) > max(own, newest_segment):
            # needed only because a later segment is there, that no checkpoint ever named
            raise StraySegmentError(
                f"journal segment {later} follows a gap: {gone.name} (and any up to it) was never there "
                f"or was deleted, and no checkpoint names a segment past {max(own, newest_segment)}. "
                f"A run numbers its segments without gaps, so {later.name} is a stray file or its "
                f"predecessors were deleted; move {later} away if it is not this run's and resume again")
        raise CorruptionError(f"journal segment {gone}, which checkpoint {ckpt_dir.name} continues from, "
                              "is missing")
    return manifest


def has_checkpoint(ckpt_root: Path) -> bool:
    """Whether ``ckpt_root`` holds a checkpoint (``latest`` or a step directory), intact or not."""
    return (ckpt_root / LATEST).is_file() or bool(checkpoint_dirs(ckpt_root))


def _published_versions(weights_dir: Path) -> int:
    """The newest version published in ``weights_dir`` as files (-1: none)."""
    names = (p.name for p in weights_dir.iterdir()) if weights_dir.is_dir() else ()
    return max((int(n[1:9]) for n in names if re.fullmatch(r"v\d{8}(\.safetensors)?", n)), default=-1)


def restart_problem(run_dir: Path, journal: Journal | None) -> str | None:
    """For a run directory without any checkpoint: why a resume from step 0 would discard training
    on record (one paragraph), or None when the journal (None: there is no journal directory) can
    redo all of it (module docstring)."""
    from saorl.data.jsonl import read_jsonl
    from saorl.runtime.recorder import effective_rows

    again = (f"To train this directory again from step 0 anyway (the old rows stay in trained.jsonl and "
             f"metrics.jsonl, behind a resume marker), resume with `saorl train --resume {run_dir} "
             "--restart`; or start a new run with a new --run-dir.")
    paths = RunPaths(run_dir)
    first = journal.segments() if journal is not None else []
    if first and first[0].name != "seg-00000000.jsonl":
        return (f"{paths.checkpoints} holds no checkpoint, but the journal starts at {first[0].name}: "
                "earlier segments were pruned when checkpoints were written, so the checkpoints were "
                "deleted. Restore them if you have a copy; resuming without them would train from step 0 "
                f"on a fraction of the run's rollouts. {again}")
    rows = read_jsonl(paths.trained)
    trained = effective_rows(rows)
    steps = [r for r in effective_rows(read_jsonl(paths.metrics)) if r["step"] > 0]
    base = max((int(r["resume"].get("version", 0)) for r in rows if "resume" in r), default=0)
    published = _published_versions(paths.weights)
    journalled = {t.episode.rid for t in journal.read_from(0)} if journal is not None else set()
    rids = {rid for r in trained for rid in r["rids"]}
    if not rids - journalled and (journalled or not (steps or published > base)):
        return None
    found = []
    if trained:
        found.append(f"trained.jsonl records {len(trained)} trained steps (the last, step "
                     f"{trained[-1]['step']}) on {len(rids)} rollouts")
    if steps:
        found.append(f"metrics.jsonl has {len(steps)} step rows (the last, step {steps[-1]['step']})")
    if published > base:
        found.append(f"weights/ holds version {published}, published after a trained step")
    held = "none" if not journalled & rids else f"only {len(journalled & rids)}"
    where = paths.journal if journal is None else journal.dir
    journal_says = (f"{where} holds {held} of the {len(rids)} rollouts trained.jsonl records as trained"
                    if rids else f"{where} holds no rollout")
    return (f"{paths.checkpoints} holds no checkpoint and {journal_says}, yet the run's record shows "
            f"training: {'; '.join(found)}. The checkpoints and the journal were deleted (or replaced), "
            "and a resume would restart from step 0, silently discarding that training. Restore "
            f"checkpoints/ and journal/ from a copy if you have one. {again}")


def check_restart(run_dir: Path, *, restart: bool = False) -> None:
    """Before a resume's slow work: :class:`CorruptionError` when ``run_dir`` holds no checkpoint
    and a restart from step 0 would discard training on record (:func:`restart_problem`), unless
    ``restart``. (A damaged checkpoint is found later, when the resume verifies it.)"""
    paths = RunPaths(run_dir)
    if restart or has_checkpoint(paths.checkpoints):
        return
    journal = Journal(paths.journal) if paths.journal.is_dir() else None
    try:
        problem = restart_problem(run_dir, journal)
    finally:
        if journal is not None:
            journal.close()
    if problem is not None:
        raise CorruptionError(f"cannot resume: {problem}")


def resume_checkpoint(ckpt_root: Path, journal: Journal, *, fallback: bool, log: Callable[[str], None],
                      restart: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its verified manifest, or None when there is none and a
    resume may start from step 0: the journal redoes the training on record, or ``restart``
    (see the module docstring for what is checked and the fallback)."""
    dirs = checkpoint_dirs(ckpt_root)
    pointer = ckpt_root / LATEST
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
    if named is None and not dirs:
        problem = None if restart else restart_problem(ckpt_root.parent, journal)
        if problem is not None:
            raise CorruptionError(f"cannot resume: {problem}")
        return None
    newest = max(_journal_segments(ckpt_root), default=0)  # a newer checkpoint's segment existed
    if named is None:
        problem = f"{pointer} is missing"
    elif not _STEP_DIR.fullmatch(named) or not (ckpt_root / named).is_dir():
        problem = f"{pointer} names {named[:40]!r}, which is not a checkpoint directory in {ckpt_root}"
    else:
        try:
            return ckpt_root / named, verify(ckpt_root / named, journal, newest)
        except StraySegmentError as e:  # the journal's, not the checkpoint's: no other one is better
            raise CorruptionError(f"cannot resume: {e}. The checkpoints are not at fault") from None
        except CorruptionError as e:
            problem = str(e)
    return _fall_back(ckpt_root, journal, named, problem, newest, fallback, log)


def _fall_back(ckpt_root: Path, journal: Journal, named: str | None, problem: str, newest: int,
               fallback: bool, log: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    damaged = ckpt_root / named if named and _STEP_DIR.fullmatch(named) else None
    damaged = damaged if damaged is not None and damaged.is_dir() else None
    rejected = []
    for d in reversed(checkpoint_dirs(ckpt_root)):
        if d == damaged:
            continue
        try:
            manifest = verify(d, journal, newest)
        except StraySegmentError as e:
            raise CorruptionError(f"cannot resume: {e}. The checkpoints are not at fault") from None
        except CorruptionError as e:
            rejected.append(str(e))
            continue
        if not fallback:
            raise CorruptionError(
                f"cannot resume: {problem}. The intact checkpoint {d.name} (step {manifest['step']}) is "
                "there: resume again without run.resume_fallback=false to continue from it (the steps "
                "after it are redone from the journal), or restore the damaged file if you have a copy.")
        aside = ""
        if damaged is not None:
            target = _aside_name(ckpt_root, damaged.name)
            os.replace(damaged, target)
            aside = f" The damaged checkpoint was moved to {target}."
        _point_latest(ckpt_root, d.name)
        log(f"resume: {problem}. Continuing from the newest intact checkpoint, {d.name} (step "
            f"{manifest['step']}); the steps after it are redone from the journal, and trained.jsonl "
            f"and metrics.jsonl get a resume marker.{aside} To stop instead, resume with "
            "run.resume_fallback=false.")
        return d, manifest
    also = f" Earlier checkpoints are damaged too: {'; '.join(rejected)}." if rejected else ""
    raise CorruptionError(
        f"cannot resume: {problem}, and no intact earlier checkpoint is left to fall back to.{also} "
        "Restore the damaged file from a copy if you have one, or start a new run (a new --run-dir); "
        "the run is not restarted from step 0, which would silently discard its training.")


def _aside_name(ckpt_root: Path, name: str) -> Path:
    target, n = ckpt_root / f"damaged-{name}", 1
    while target.exists():
        target, n = ckpt_root / f"damaged-{name}-{n}", n + 1
    return target


# ------------------------------------------------------------------------------------ load
def load_checkpoint(ckpt_dir: Path, learner, manifest: dict[str, Any]) -> list[Trajectory]:
    """Restore the learner in place from a checkpoint :func:`verify` passed (``manifest`` is what
    it returned); return the pending trajectories."""
    learner.load_state(ckpt_dir, manifest)  # weights, optimizers and the learner's counters
    torch.set_rng_state(load_safetensors(ckpt_dir / "rng.safetensors")["torch"])
    s = manifest["python_rng"]
    random.setstate((s[0], tuple(s[1]), s[2]))
    lines = (ckpt_dir / "pending.jsonl").read_text(encoding="utf-8").splitlines()
    return [decode_entry(line) for line in lines]
