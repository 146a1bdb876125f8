"""Versioned weight publication from the trainer to rollout workers, through files.

The trainer writes ``v{version:08d}.safetensors`` atomically (temp file + fsync + rename), then
atomically replaces ``latest.json`` (``{"version": N, "file": "v0000000N.safetensors"}``).
A worker only ever opens a file named by ``latest.json``, so it never sees half-written
weights. Old versions are pruned, keeping the newest ``keep`` files so a worker that read the
pointer a moment ago can still open its file.

This is the local backend's :class:`WeightSync`; a Ray or NCCL implementation publishes the same
(version, tensors) pairs by other means. Readers get the *path* of the newest version
(:meth:`latest`), which an engine loads itself (the local engine reads the file, an HTTP server
is told the path), so no reader copies the tensors to a file of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file

from saorl.models.serialize import save_safetensors_atomic


class WeightSync(Protocol):
    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Make ``state_dict`` the newest weights, tagged ``version``."""
        ...

    def latest(self) -> tuple[int, str] | None:
        """``(version, path of its safetensors file)`` of the newest weights, or None."""
        ...

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (or ``version``'s) weights as tensors, or None."""
        ...


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileWeightSync:
    """Publish / poll versioned policy weights in a directory shared by trainer and workers."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(2, keep)
        self._pointer = self.dir / "latest.json"

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        name = f"v{version:08d}.safetensors"
        save_safetensors_atomic(state_dict, self.dir / name)
        _write_json_atomic(self._pointer, {"version": version, "file": name})
        self._prune()

    def _prune(self) -> None:
        files = sorted(self.dir.glob("v*.safetensors"))
        for old in files[: -self.keep]:
            old.unlink(missing_ok=True)

    def _read_pointer(self) -> dict | None:
        try:
            return json.loads(self._pointer.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def latest(self) -> tuple[int, str] | None:
        p = self._read_pointer()
        return None if p is None else (int(p["version"]), str(self.dir / p["file"]))

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest published weights (or ``version``'s), or None if nothing is published."""
        p = self._read_pointer()
        if p is None:
            return None
        if version is not None and version != p["version"]:
            name = f"v{version:08d}.safetensors"
        else:
            version, name = int(p["version"]), p["file"]
        try:
            return int(version), load_file(str(self.dir / name))
        except FileNotFoundError:
            return None  # pruned between pointer read and open; the caller polls again
