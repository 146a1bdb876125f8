"""The seam of weight publication: the trainer's :class:`WeightPublisher`, a reader's
:class:`WeightSource`, and :class:`WeightNames`, the form a published version takes.

Implementations: files (:mod:`saorl.runtime.weights.files`, the local backend's; the module
docstring there says how a version is laid out and pruned), inference servers updated in place
(:mod:`saorl.runtime.weights.servers`) and Ray's object store (:mod:`saorl.runtime.weights.ray_store`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch


@dataclass(frozen=True)
class WeightNames:
    """How a publication's tensors are named, and so the form its version takes on disk:
    ``model`` (the model's in-memory names: one ``v{N:08d}.safetensors``; the single-process
    trainer, whose engine holds the same model class), ``checkpoint`` (Hugging Face checkpoint
    names: a model directory, ``config`` its ``PretrainedConfig``; the sharded trainer) or
    ``adapter`` (a LoRA adapter in peft's names, ``config`` its ``adapter_config.json`` content)."""

    form: Literal["model", "checkpoint", "adapter"] = "model"
    config: Any = None

    @classmethod
    def checkpoint(cls, config: Any) -> WeightNames:
        return cls("checkpoint", config)

    @classmethod
    def adapter(cls, config: dict) -> WeightNames:
        return cls("adapter", config)


MODEL_NAMES = WeightNames()
"""A publication in the model's in-memory names (the default)."""


class WeightPublisher(Protocol):
    """The trainer's side of weight publication."""

    def publish(self, buckets: Iterable[dict[str, torch.Tensor]], version: int,
                names: WeightNames = MODEL_NAMES) -> None:
        """Make the tensors of ``buckets`` (each consumed before the next is drawn) the newest
        weights, tagged ``version``, named as ``names`` says."""
        ...

    def published_version(self) -> int | None:
        """The newest version on record (this publisher's or an earlier process's), or None."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the publications since the last call measured (a server check's gap), else {}."""
        ...

    def close(self) -> None:
        """Release what publishing holds (a server client's connections); the files stay."""
        ...


class WeightSource(Protocol):
    """A reader's side (a rollout worker's engine): where the newest weights are."""

    def latest(self) -> tuple[int, Any] | None:
        """``(version, source)`` of the newest weights, or None; ``source`` is what
        ``InferenceEngine.update_weights`` takes (a path, or a state dict in in-memory names)."""
        ...

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (or ``version``'s) weights as tensors, or None."""
        ...


def merged(buckets: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict of every bucket's tensors."""
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        out |= bucket
    return out
