"""Safetensors checkpoints, written atomically: policies as HF directories, critics, raw tensor dicts.

Atomicity: every file and directory here is written through :mod:`saorl.atomic` (replaced whole or
not at all).

Layouts:
- ``export_policy``: what ``save_pretrained`` writes (``config.json``, ``model.safetensors``,
  ``generation_config.json``; MoE experts in the per-expert on-disk format transformers converts
  to) plus the tokenizer files, so ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``
  load it directly.
- ``save_critic``: ``config.json`` (the trunk's HF config), ``critic.json`` (format marker and
  head shape), ``critic.safetensors`` (``trunk.*`` and ``value_head.*``, the in-memory names).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig, AutoModel

from saorl.atomic import atomic_dir, atomic_file
from saorl.models.critic import Critic
from saorl.models.loading import ensure_cpu_experts, resolve_dtype

CRITIC_FORMAT = "saorl-critic"
CRITIC_VERSION = 1
CRITIC_WEIGHTS = "critic.safetensors"


def _prepare(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors, none sharing storage (tied weights are cloned)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if not isinstance(t, Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_safetensors_atomic(
    tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None,
) -> Path:
    """Write ``tensors`` to ``path`` atomically (tmp in the same directory, fsync, ``os.replace``).

    Tensors may live on any device, be non-contiguous or share storage (tied weights): each is
    saved as its own contiguous CPU copy. ``metadata``: optional str → str header entries.
    """
    prepared = _prepare(tensors)
    with atomic_file(path) as tmp:
        save_file(prepared, str(tmp), metadata=metadata)
    return Path(path)


def load_safetensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """All tensors of a safetensors file, on ``device``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {str(path)!r} does not exist")
    return load_file(str(path), device=str(device))


def export_policy(model, tokenizer, out_dir: str | Path) -> Path:
    """Write ``model`` + ``tokenizer`` as an HF directory at ``out_dir`` (atomically replaced).

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and ``AutoTokenizer.from_pretrained(out_dir)``
    load it back; tied embeddings are stored once, as ``save_pretrained`` does.
    """
    if tokenizer is None:
        raise ValueError("export_policy needs a tokenizer: an HF directory without one cannot be served")
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if not (tmp / "config.json").is_file() or not any(tmp.glob("*.safetensors")):
            raise RuntimeError(f"save_pretrained wrote no config.json/safetensors into {tmp}")
    return Path(out_dir)


def save_critic(critic: Critic, out_dir: str | Path) -> Path:
    """Write a critic directory (config.json, critic.json, critic.safetensors) atomically."""
    if getattr(critic, "lora", False):  # plain layout, adapter merged in (a run attaches a fresh one)
        critic = critic.merged()
    head = critic.value_head
    meta = {
        "format": CRITIC_FORMAT, "version": CRITIC_VERSION,
        "trunk_class": type(critic.trunk).__name__,
        "hidden_size": head.in_features, "weights": CRITIC_WEIGHTS,
    }
    with atomic_dir(out_dir) as tmp:
        critic.trunk.config.to_json_file(str(tmp / "config.json"))
        (tmp / "critic.json").write_text(json.dumps(meta, indent=2) + "\n")
        save_safetensors_atomic(critic.state_dict(), tmp / CRITIC_WEIGHTS, metadata={"format": "pt"})
    return Path(out_dir)


def _read_critic_meta(path: Path) -> dict:
    for name in ("config.json", "critic.json", CRITIC_WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"critic directory {str(path)!r} has no {name}; it was not written by save_critic"
            )
    meta = json.loads((path / "critic.json").read_text())
    if meta.get("format") != CRITIC_FORMAT or meta.get("version") != CRITIC_VERSION:
        raise ValueError(
            f"{str(path / 'critic.json')!r}: format {meta.get('format')!r} v{meta.get('version')!r}, "
            f"expected {CRITIC_FORMAT!r} v{CRITIC_VERSION}"
        )
    return meta


def load_critic(
    out_dir: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
) -> Critic:
    """A ``Critic`` from a ``save_critic`` directory; the trunk keeps its saved dtype unless ``dtype``."""
    path = Path(out_dir)
    if not path.exists():
        raise FileNotFoundError(f"critic directory {str(path)!r} does not exist")
    meta = _read_critic_meta(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    state = load_safetensors(path / CRITIC_WEIGHTS)
    trunk_dtype = next(v.dtype for k, v in state.items() if k.startswith("trunk.") and v.is_floating_point())
    trunk = AutoModel.from_config(config).to(dtype=trunk_dtype)
    if type(trunk).__name__ != meta["trunk_class"]:
        raise ValueError(f"config.json builds {type(trunk).__name__}, critic.json says {meta['trunk_class']}")
    critic = Critic(trunk)
    critic.load_state_dict(state, strict=True)
    if dtype is not None:
        critic.trunk.to(dtype=resolve_dtype(dtype))
    critic.to(device=device)
    ensure_cpu_experts(critic.trunk, device)
    return critic


@contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off inside the block (saving or loading once per step would
    print them every step)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
