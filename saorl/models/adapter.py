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


def adapter_deltas(config: dict, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{"<module>.weight": s·B·A}`` (float32) in the plain model's own names."""
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, None, {}, [], False):
            raise ValueError(f"adapter has {key}={config[key]!r}; only plain LoRA adapters can be merged")
    scale = adapter_scale(config)
    out: dict[str, Tensor] = {}
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
        out[own + ".weight"] = (b.float() @ a.float()) * scale
    return out


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
               own: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The new weights (the model's names and dtypes) of the modules the adapter at ``path``
        targets: base + ``s·B·A``, summed in float32. ``own``: the model's weights as its engine
        holds them (default its state dict)."""
        config, tensors = read_adapter(path)
        deltas = adapter_deltas(config, tensors)
        with self._lock:
            own = model.state_dict() if own is None else own
            unknown = sorted(set(deltas) - set(own))
            if unknown:
                raise ValueError(f"adapter {str(path)!r} targets weights the model does not have: "
                                 f"{unknown[:5]}")
            out = {}
            for name, delta in deltas.items():
                if name not in self._base:
                    self._base[name] = own[name].detach().clone()
                base = self._base[name]
                if tuple(delta.shape) != tuple(base.shape):
                    raise ValueError(f"adapter {str(path)!r}: the update of {name} has shape "
                                     f"{tuple(delta.shape)}, the model's weight {tuple(base.shape)}")
                out[name] = (base.float() + delta.to(base.device)).to(base.dtype)
            # a module an earlier adapter targeted and this one does not goes back to its base
            out |= {name: base for name, base in self._base.items() if name not in out}
            return out
