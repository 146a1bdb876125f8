"""Versioned weight publication from the trainer to rollout workers, through files.

Weight publication has two sides (the seam, :mod:`saorl.runtime.weights.base`): the trainer's
:class:`WeightPublisher` and a reader's :class:`WeightSource`; here are their file forms. Both
learners publish the same way, ``publish(buckets, version, names)``, and :class:`WeightNames` says
which of three forms the version takes in ``RUN/weights``:

- the model's in-memory names: one ``v{version:08d}.safetensors`` (the single-process trainer:
  trainer and engine hold the same model class);
- Hugging Face checkpoint names: a directory ``v{version:08d}/`` — ``config.json``, shard files
  and ``model.safetensors.index.json`` — written bucket by bucket, one bucket in memory at a time
  (the sharded trainer: what inference servers load, :mod:`saorl.models.hf_format`);
- a LoRA policy's adapter alone: the directory ``v{version:08d}-adapter/`` in peft's layout
  (:mod:`saorl.models.adapter`; a fraction of the full weights' size, measured in
  docs/models.md), which the local engine merges into the base it loaded.

Each is written atomically (temp file or directory + fsync + rename), then ``latest.json``
(``{"version": N, "file": "v0000000N..."}``) is replaced atomically. A reader
(:class:`FileSource`) only ever opens what ``latest.json`` names, so it never sees half-written
weights.

Old versions are pruned by the order they were *published*, not by version number: those of
this publisher's last ``keep`` publications stay (so a worker that read the pointer a moment ago
can still open its version), versions left by an earlier process count as older than anything
published now, and the version ``latest.json`` names is never deleted. So publishing a lower
version than those on disk (11, 12, 13, then 10) leaves 10 loadable. The run itself never goes
back: a resumed run continues the version numbers above every version already published
(:meth:`WeightPublisher.published_version`, read by :func:`~saorl.runtime.resume.restore`), so one
number always names one set of weights.

These are the local backend's publisher and source; :mod:`saorl.runtime.weights.ray_store`
publishes the same versions through Ray's object store, and :mod:`saorl.runtime.weights.servers`
puts them on inference servers as well. A source gives the *source* of the newest version (:meth:`latest`) —
here the path, which an engine loads itself (the local engine reads the file or directory, an
HTTP server is told the path), so no reader copies the tensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from saorl.atomic import atomic_dir, write_json
from saorl.models.adapter import is_adapter_dir, read_adapter, write_adapter_dir
from saorl.models.hf_format import INDEX, write_index
from saorl.models.serialize import save_safetensors_atomic
from saorl.runtime.weights.base import MODEL_NAMES, WeightNames, WeightPublisher, WeightSource, merged

__all__ = ["MODEL_NAMES", "FilePublisher", "FileSource", "WeightNames", "WeightPublisher", "WeightSource",
           "merged", "read_pointer", "write_checkpoint_dir"]


POINTER = "latest.json"
"""The file naming the newest version: ``{"version": N, "file": "v0000000N..."}``."""
ADAPTER_SUFFIX = "-adapter"
"""A published LoRA adapter: the directory ``v{version:08d}-adapter`` (peft's layout)."""
_VERSION = re.compile(r"v\d{8}(\.safetensors|-adapter)?")
"""A published version: a file of a state dict, a checkpoint-named directory or an adapter."""


def write_checkpoint_dir(buckets: Iterable[dict[str, torch.Tensor]], config: Any, out_dir: Path) -> Path:
    """A Hugging Face model directory at ``out_dir``, atomically: ``config.json``, one
    ``model-0000k-of-0000n.safetensors`` per bucket (each written as it arrives) and
    ``model.safetensors.index.json``."""
    with atomic_dir(out_dir) as tmp:
        weight_map, total, parts = {}, 0, []
        for i, bucket in enumerate(buckets):
            part = f"bucket-{i:05d}.safetensors"
            save_safetensors_atomic(bucket, tmp / part, metadata={"format": "pt"})
            parts.append((part, list(bucket)))
            total += sum(t.numel() * t.element_size() for t in bucket.values())
        for i, (part, names) in enumerate(parts):  # the standard shard names, now that n is known
            final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            os.replace(tmp / part, tmp / final)
            weight_map |= dict.fromkeys(names, final)
        write_index(tmp, weight_map, total)
        config.to_json_file(str(tmp / "config.json"))
    return out_dir


class FilePublisher:
    """Publish versioned policy weights into a directory that trainer and workers share."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(2, keep)
        self._pointer = self.dir / POINTER
        self._published: list[str] = []  # version names, in the order this object published them

    def publish(self, buckets: Iterable[dict[str, torch.Tensor]], version: int,
                names: WeightNames = MODEL_NAMES) -> None:
        self.announce(version, self.write(buckets, version, names).name)

    def write(self, buckets: Iterable[dict[str, torch.Tensor]], version: int, names: WeightNames) -> Path:
        """Write a version's file or directory (complete, atomically) without announcing it."""
        if names.form == "checkpoint":
            return write_checkpoint_dir(buckets, names.config, self.dir / f"v{version:08d}")
        if names.form == "adapter":
            out = self.dir / f"v{version:08d}{ADAPTER_SUFFIX}"
            write_adapter_dir(merged(buckets), names.config, out)
            return out
        path = self.dir / f"v{version:08d}.safetensors"
        save_safetensors_atomic(merged(buckets), path)
        return path
    def announce(self, version: int, name: str) -> None:
        """Point readers at ``name`` (a file or directory under this one, already complete) as
        ``version``."""
        write_json(self._pointer, {"version": version, "file": name})
        if name in self._published:
            self._published.remove(name)
        self._published.append(name)
        self._prune()

    def _prune(self) -> None:
        current, mine = self._published[-1], set(self._published)
        earlier = sorted(p.name for p in self.dir.glob("v*")
                         if _VERSION.fullmatch(p.name) and p.name not in mine)
        for name in (earlier + self._published)[: -self.keep]:  # oldest publication first
            old = self.dir / name
            if name == current:
                continue
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        self._published = self._published[-self.keep:]

    def published_version(self) -> int | None:
        p = read_pointer(self.dir)
        return None if p is None else int(p["version"])

    def metrics(self) -> dict[str, float]:
        return {}  # nothing measured: the weights are read back as written

    def close(self) -> None:
        pass


def read_pointer(directory: Path) -> dict | None:
    """``latest.json`` of a weights directory, or None before the first publication."""
    try:
        return json.loads((directory / POINTER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class FileSource:
    """Read the newest weights a :class:`FilePublisher` announced in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def latest(self) -> tuple[int, str] | None:
        p = read_pointer(self.dir)
        return None if p is None else (int(p["version"]), str(self.dir / p["file"]))

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest published weights (or ``version``'s), or None if nothing is published."""
        p = read_pointer(self.dir)
        if p is None:
            return None
        if version is not None and version != p["version"]:
            name = f"v{version:08d}.safetensors"
        else:
            version, name = int(p["version"]), p["file"]
        path = self.dir / name
        for other in ("", ADAPTER_SUFFIX):
            if not path.exists() and version is not None:
                path = self.dir / f"v{version:08d}{other}"
        try:
            if is_adapter_dir(path):  # a LoRA adapter: its tensors, in peft's names
                return int(version), read_adapter(path)[1]
            if path.is_dir():  # a checkpoint-named directory: its shards, merged
                index = json.loads((path / INDEX).read_text())
                out = {}
                for part in sorted(set(index["weight_map"].values())):
                    out |= load_file(str(path / part))
                return int(version), out
            return int(version), load_file(str(path))
        except FileNotFoundError:
            return None  # pruned between pointer read and open; the caller polls again
