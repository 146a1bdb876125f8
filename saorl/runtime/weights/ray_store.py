"""Published weights through Ray's object store, for clusters without a shared filesystem.

The trainer (the Ray driver) puts each version's tensors into the object store — one object per
bucket (``ray.put``) — and records ``(version, refs, config)`` in :class:`WeightRegistry`, a small
actor that keeps the newest ``keep`` versions. The registry holds the references, so the objects
stay alive while it lists them and Ray frees them once it drops them and no worker still reads
them. A worker's :meth:`RaySource.latest` asks the registry for the newest version number (a
tiny call), fetches the objects only when that number is new, and hands the engine a state dict
in its own names: a version published in Hugging Face checkpoint names (the sharded trainer's) is
converted back by transformers (:func:`saorl.models.hf_format.from_checkpoint`).

A version is visible only once all its objects are in the store and the registry has recorded
them, so a worker never reads half a version (the file publisher's ``latest.json`` promise).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray
import torch

from saorl.runtime.weights.base import MODEL_NAMES, WeightNames, merged


@ray.remote(num_cpus=0)
class WeightRegistry:
    """``version -> (refs, config)`` of the newest published versions."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = max(1, keep)
        self.versions: dict[int, tuple[list, Any]] = {}

    def set(self, version: int, refs: list, config: Any) -> None:
        self.versions[version] = (refs, config)
        for old in sorted(self.versions)[: -self.keep]:
            del self.versions[old]

    def latest_version(self) -> int | None:
        return max(self.versions) if self.versions else None

    def get(self, version: int) -> tuple[list, Any] | None:
        return self.versions.get(version)


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def ray_weights(keep: int = 2) -> tuple[RayPublisher, RaySource]:
    """The trainer's publisher and the workers' source of one new registry."""
    registry = WeightRegistry.remote(keep)
    return RayPublisher(registry), RaySource(registry)


class RayPublisher:
    """:class:`~saorl.runtime.weights.files.WeightPublisher` into the object store (module docstring)."""

    def __init__(self, registry) -> None:
        self.registry = registry

    def publish(self, buckets: Iterable[dict[str, torch.Tensor]], version: int,
                names: WeightNames = MODEL_NAMES) -> None:
        if names.form == "adapter":
            raise NotImplementedError("ray.weights=object_store carries full weights only; a LoRA run "
                                      "publishes its adapters as files (ray.weights=shared_fs)")
        if names.form == "checkpoint":
            refs = [ray.put(_cpu(bucket)) for bucket in buckets]
        else:
            refs = [ray.put(_cpu(merged(buckets)))]
        ray.get(self.registry.set.remote(version, refs, names.config))

    def published_version(self) -> int | None:
        return ray.get(self.registry.latest_version.remote())

    def metrics(self) -> dict[str, float]:
        return {}  # nothing measured: the weights are read back as written

    def close(self) -> None:
        pass  # the object store's references go with the Ray cluster


class RaySource:
    """:class:`~saorl.runtime.weights.files.WeightSource` from the object store (module docstring).

    Picklable: workers receive it with the registry's handle and no cached tensors."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None

    def __getstate__(self) -> dict:
        return {"registry": self.registry, "_cache": None}

    def _fetch(self, version: int | None) -> tuple[int, dict[str, torch.Tensor], Any] | None:
        if version is None:
            version = ray.get(self.registry.latest_version.remote())
            if version is None:
                return None
        entry = ray.get(self.registry.get.remote(version))
        if entry is None:
            return None  # dropped between the two calls: a newer one is published
        refs, config = entry
        tensors: dict[str, torch.Tensor] = {}
        for part in ray.get(refs):
            tensors |= {k: v.clone() for k, v in part.items()}  # own memory, not the store's
        return version, tensors, config

    def latest(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version as a state dict in the engine's names (fetched once per version)."""
        newest = ray.get(self.registry.latest_version.remote())
        if newest is None:
            return None
        if self._cache is not None and self._cache[0] == newest:
            return self._cache
        got = self._fetch(newest)
        if got is None:
            return self._cache
        version, tensors, config = got
        if config is not None:  # checkpoint names: back to the model's own
            from saorl.models.hf_format import from_checkpoint

            dtype = next(iter(tensors.values())).dtype
            tensors = from_checkpoint(config, tensors, dtype=dtype)
        self._cache = (version, tensors)
        return self._cache

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (or ``version``'s) tensors as published (checkpoint names if so), or None."""
        got = self._fetch(version)
        return None if got is None else (got[0], got[1])
