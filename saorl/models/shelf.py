"""The policies a process has in memory, handed from one start-up phase to the next.

``saorl train`` runs several phases before RL step 1 that each want the policy: the start-up
estimate's calibration (times it, borrowed), the SFT warm start (trains ``model.policy``), value
pretraining (samples with the warm start and copies its trunk into the critics) and the run's
parts (the trainer's copy, and the in-process backend's engine). Each used to load it from disk
again. A :class:`PolicyShelf` holds what a phase has in memory, under
what :func:`~saorl.models.loading.load_policy` would load — the source, the dtype, the device (and
a tiny kind's seed) — so the next phase asking for the same takes it instead of loading it again:

- :meth:`PolicyShelf.take`: the caller may change the model (train it); it leaves the shelf;
- :meth:`PolicyShelf.borrow`: the caller only reads it (samples, copies a trunk); it stays on the
  shelf for the next phase;
- :meth:`PolicyShelf.put`: a phase hands on a model it made (SFT's trained policy, once exported).

A held model has the weights a load would read (the exported SFT policy is what ``from_pretrained``
reads back, bit for bit), put back in the state a fresh load is in (eval mode, the attention
implementation it was loaded with, no gradients, ``name_or_path``). A load draws nothing from
torch's global RNG (a tiny kind is built under its own seed), so a load skipped shifts no random
stream; the fixed-seed fingerprint (``benchmarks/run_fingerprint.py``) is the same bit for bit. A
request with another dtype or device loads its own (float16 runs train in float32: value
pretraining's float16 sampler and the trainer's float32 copy are two models).

The shelf hands on the model itself, never a copy where a load was: a loaded model's tensors sit in
the safetensors file's mapping (not 64-byte aligned), a copy's in fresh allocations, and the local
engine's log-probs of the two differ by ~1e-7 (the tokens sampled do not). So the in-process
backend's engine, which needs a model of its own, still loads one, as the rollout workers do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from saorl.models.loading import load_policy, resolve_dtype
from saorl.models.source import ModelSource, parse

Key = tuple[str, str, str, str]


class PolicyShelf:
    """Policies in memory keyed by what :func:`load_policy` would load (module docstring).

    ``loader`` is :func:`load_policy` (a test counts its calls)."""

    def __init__(self, loader: Callable[..., PreTrainedModel] = load_policy) -> None:
        self._held: dict[Key, PreTrainedModel] = {}
        self._loader = loader
        self.loads = 0
        """How many models this shelf loaded (the rest were handed on)."""

    @staticmethod
    def key(spec: str | ModelSource, *, dtype: str | torch.dtype, device: str | torch.device,
            seed: int) -> Key:
        """What a model is held under: its source (a tiny kind with its seed, else the resolved
        local directory), dtype and device."""
        source = parse(spec, "policy")
        where = f"{source.spec}@seed={seed}" if source.tiny else str(Path(source.load_spec).resolve())
        return source.kind, where, str(resolve_dtype(dtype)), _device_name(device)

    def _load(self, spec, dtype, device, seed) -> PreTrainedModel:
        self.loads += 1
        return self._loader(spec, dtype=dtype, device=device, seed=seed)

    def take(self, spec: str | ModelSource, *, dtype: str | torch.dtype = "float32",
             device: str | torch.device = "cpu", seed: int = 0) -> PreTrainedModel:
        """The held model for these arguments, off the shelf (the caller may change it), else a
        fresh :func:`load_policy`."""
        held = self._held.pop(self.key(spec, dtype=dtype, device=device, seed=seed), None)
        return held if held is not None else self._load(spec, dtype, device, seed)

    def borrow(self, spec: str | ModelSource, *, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", seed: int = 0) -> PreTrainedModel:
        """The held model for these arguments (loaded and held first if there is none); it stays on
        the shelf, so the caller must leave its weights and settings as they are."""
        key = self.key(spec, dtype=dtype, device=device, seed=seed)
        if key not in self._held:
            self._held[key] = self._load(spec, dtype, device, seed)
        return self._held[key]

    def put(self, spec: str | ModelSource, model: PreTrainedModel, *, seed: int = 0,
            attn_implementation: str | None = None) -> None:
        """Hold ``model`` as what ``load_policy(spec, seed=seed)`` in its own dtype and on its own
        device gives, after putting it in a fresh load's state: eval mode, no gradients, every
        parameter trainable, and ``attn_implementation`` (what it was loaded with, when a phase
        switched it) back. A model already held under that key is replaced."""
        p = next(model.parameters())
        source = parse(spec, "policy")
        if not source.tiny:  # what from_pretrained records (a LoRA adapter's base names it)
            model.config._name_or_path = source.load_spec
            for module in model.modules():
                if isinstance(module, PreTrainedModel):
                    module.name_or_path = source.load_spec
        if attn_implementation is not None and model.config._attn_implementation != attn_implementation:
            model.set_attn_implementation(attn_implementation)
        model.zero_grad(set_to_none=True)
        model.requires_grad_(True)
        self._held[self.key(spec, dtype=p.dtype, device=p.device, seed=seed)] = model.eval()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        """Let go of every held model (the start-up is over: what no phase took is freed)."""
        self._held.clear()


def _device_name(device: str | torch.device) -> str:
    """``device`` as a parameter's ``.device`` names it (``cuda`` is the current GPU's index)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)
