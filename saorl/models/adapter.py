"""LoRA adapters on disk in peft's layout, and merging one into a plain model's weights.

An adapter directory is what ``peft``'s ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors``, whose tensors are named ``base_model.model.<module>.lora_A.weight``
(``r × in``) and ``...lora_B.weight`` (``out × r``) for each adapted ``nn.Linear`` ``<module>``.
The module ``<module>`` computes ``W·x + s·B·A·x`` with ``s = lora_alpha / r`` (``lora_alpha /
√r`` with ``use_rslora``), so merged it is the weight ``W + s·B·A``.

This module needs no ``peft``: the local engine applies published adapters with it
(:class:`AdapterMerger`), and a trainer publishes them with :func:`write_adapter_dir`. Only the
plain LoRA that :mod:`saorl.models.lora` builds is read here; an adapter with DoRA, per-module
ranks or extra trained modules is refused rather than merged wrongly.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from saorl.atomic import atomic_dir
from saorl.models.serialize import save_safetensors_atomic

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_PLAIN = {"use_dora": False, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
          "modules_to_save": None, "lora_bias": False,
          "target_parameters": None}
"""Settings an adapter must have (or lack) for :func:`adapter_deltas` to merge it exactly."""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a peft adapter (``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def write_adapter_dir(tensors: dict[str, Tensor], config: dict, out_dir: str | Path) -> Path:
    """An adapter directory at ``out_dir``, atomically: ``tensors`` (peft's names) and ``config``
    (``adapter_config.json``, as peft writes it)."""
    with atomic_dir(out_dir) as tmp:
        save_safetensors_atomic(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)


def read_adapter(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """``(adapter_config, tensors)`` of the adapter directory ``path``."""
    path = Path(path)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    return config, load_file(str(path / ADAPTER_WEIGHTS))


def adapter_scale(config: dict) -> float:
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / r ** 0.5 if config.get("use_rslora") else alpha / r


def adapter_factors(config: dict, tensors: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{"<module>.weight": (B, A)}`` in the plain model's own names, the adapter checked to be plain
    LoRA (:data:`_PLAIN`); the update of each weight is ``s·B·A`` (:func:`adapter_scale`)."""
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, None, {}, [], False):
            raise ValueError(f"adapter has {key}={config[key]!r}; only plain LoRA adapters can be merged")
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            if not name.endswith(".lora_B.weight"):
                raise ValueError(f"adapter tensor {name!r} is not a LoRA A or B matrix")
            continue
        module = name[: -len(".lora_A.weight")]
        b = tensors.get(module + ".lora_B.weight")
        if b is None:
            raise ValueError(f"adapter has {name!r} but no {module}.lora_B.weight")
        own = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
        out[own + ".weight"] = (b, a)
    return out


def _delta(b: Tensor, a: Tensor, scale: float) -> Tensor:
    return (b.float() @ a.float()) * scale


def adapter_deltas(config: dict, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{"<module>.weight": s·B·A}`` (float32) in the plain model's own names."""
    scale = adapter_scale(config)
    return {name: _delta(b, a, scale) for name, (b, a) in adapter_factors(config, tensors).items()}


class MergedWeights(Mapping[str, Tensor]):
    """The weights :meth:`AdapterMerger.merged` gives, each computed as it is read: base + ``s·B·A``
    summed in float32, or the base for a weight this adapter does not target. An engine that applies
    them a tensor at a time holds one merged weight and one update at a time, not all of both (on
    SmolLM2-135M, two more copies of the targeted weights otherwise)."""

    def __init__(self, base: Mapping[str, Tensor], factors: Mapping[str, tuple[Tensor, Tensor]],
                 scale: float) -> None:
        self._base, self._factors, self._scale = base, factors, scale
        self._names = list(factors) + [n for n in base if n not in factors]

    def __getitem__(self, name: str) -> Tensor:
        base = self._base[name]
        if name not in self._factors:
            return base
        b, a = self._factors[name]
        return (base.float() + _delta(b, a, self._scale).to(base.device)).to(base.dtype)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The weight's shape, without computing it."""
        return tuple(self._base[name].shape)


class AdapterMerger:
    """Base weights + an adapter, for an engine that holds a plain model.

    The first :meth:`merged` call keeps a copy of the weights the adapter targets, as the model
    holds them then: the base. Every adapter after it is merged into that copy, never into an
    earlier merge, so version after version the engine holds exactly base + the newest adapter.
    """

    def __init__(self) -> None:
        self._base: dict[str, Tensor] = {}
        self._lock = threading.Lock()

    def merged(self, model: torch.nn.Module, path: str | Path,
               own: Mapping[str, Tensor] | None = None) -> MergedWeights:
        """The new weights (the model's names and dtypes) of the modules the adapter at ``path``
        targets and of those an earlier adapter targeted (back to their base), computed as they are
        read (:class:`MergedWeights`). ``own``: the model's weights as its engine holds them (default
        its state dict)."""
        config, tensors = read_adapter(path)
        factors = adapter_factors(config, tensors)
        scale = adapter_scale(config)
        with self._lock:
            own = model.state_dict() if own is None else own
            unknown = sorted(set(factors) - set(own))
            if unknown:
                raise ValueError(f"adapter {str(path)!r} targets weights the model does not have: "
                                 f"{unknown[:5]}")
            for name, (b, a) in factors.items():
                if name not in self._base:
                    self._base[name] = own[name].detach().clone()
                shape, base = (b.shape[0], a.shape[1]), tuple(self._base[name].shape)
                if shape != base:
                    raise ValueError(f"adapter {str(path)!r}: the update of {name} has shape "
                                     f"{shape}, the model's weight {base}")
            return MergedWeights(dict(self._base), factors, scale)
