"""The local engine's linear layers on oneDNN-packed copies of their weights (CPU, float32).

A decode step multiplies a few rows (the running sequences) by every weight matrix of the model, so
on a CPU it is bound by how fast the weights stream from memory, not by arithmetic. PyTorch's
``F.linear`` reads the ``[out, in]`` weight as it is stored; oneDNN reads a copy reordered once
into its blocked layout, which streams 1.3-6× faster for these shapes (on this project's 2-core
machine, SmolLM2-135M's ``[8 × 576] · [576 × 1536]``: 0.19 → 0.05 ms; its vocabulary projection,
``[8 × 576] · [576 × 49152]``: 14.0 → 2.3 ms). This is the packing ``torch.compile`` does on CPU
when it freezes weights, without the compiler.

:class:`PackedLinears` keeps the packed copies of a model's ``nn.Linear`` weights and gives each
layer a forward that uses its copy **only on a thread inside** :meth:`PackedLinears.active` (the
engine's own thread, during its steps); on any other thread, or outside the block, the layer runs
``nn.Linear.forward`` on its own parameters, so a trainer, a scorer or a backward pass on the same
model sees plain layers at every moment. :meth:`PackedLinears.remove` takes the forwards away
again (the engine's ``close``). The copies are of the weights at packing time: the engine repacks
after every weight update it applies, and the model's parameters are never touched. Results equal
``F.linear``'s up to float32 rounding (a different summation order: ~1e-6 relative).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

import torch

BATCH_HINT = 16
"""The row count oneDNN is told to expect when reordering (any count works; decode batches are
a few to a few dozen rows)."""


def packing_available(model: torch.nn.Module) -> bool:
    """Whether this build of torch packs linear weights and ``model`` has float32 CPU ones."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return any(_packable(m) for m in model.modules())


def _packable(m: torch.nn.Module) -> bool:
    """A plain float32 CPU ``nn.Linear`` (a whole tensor, not a shard) whose forward nobody else
    replaced on the instance."""
    return (type(m) is torch.nn.Linear and type(m.weight.data) is torch.Tensor  # not a DTensor shard
            and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" and m.weight.dim() == 2
            and "forward" not in vars(m))


class PackedLinears:
    """Packed copies of ``model``'s float32 CPU ``nn.Linear`` weights (module docstring).

    ``release=True`` (a rollout worker's engine, whose model nothing else reads): each layer's own
    weight is freed once packed, so the weights are held once instead of twice (SmolLM2-135M: 0.4 GB
    less), and the model's other tensors are copied out of the memory map of the file they were
    loaded from, so that the map goes too. Such a weight stays a parameter of its shape whose
    storage is a single zero (a stride-0 view); the layer's forward outside :meth:`active` raises
    instead of computing with it; an update packs the new tensor directly (:meth:`set_weight`);
    :meth:`dense` and :meth:`remove` give the weight back exactly (a packed copy unpacks bit for
    bit). A weight shared with another module (a vocabulary projection tied to the embedding, which
    the lookup reads) is never released."""

    def __init__(self, model: torch.nn.Module, release: bool = False) -> None:
        named = [(name, m) for name, m in model.named_modules() if _packable(m)]
        self.layers = [m for _, m in named]
        self._packed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._on = threading.local()
        self.released: dict[str, int] = {}
        """Released weights: their state-dict name -> the layer's index."""
        self.repack()
        for i, m in enumerate(self.layers):
            m.forward = self._forward_of(m, i)
        if release:
            shared = _shared_storages(model)
            for i, (name, m) in enumerate(named):
                if m.weight.untyped_storage().data_ptr() not in shared:
                    self.released[f"{name}.weight" if name else "weight"] = i
                    m.weight.data = torch.zeros((), dtype=m.weight.dtype).expand(m.weight.shape)
            # the rest copied out of what they were loaded into: transformers loads a float32
            # safetensors file as views of one memory map, which any kept view would keep whole
            with torch.no_grad():
                for t in (*model.parameters(), *model.buffers()):
                    if t.stride() != (0,) * t.dim() or t.dim() == 0:
                        t.data = t.data.clone()

    def _forward_of(self, layer: torch.nn.Linear, i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if getattr(self._on, "active", False):
                weight, bias = self._packed[i]
                return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
            if i in self.released.values():
                raise RuntimeError("this linear layer's weight was released into the engine's packed copy "
                                   "(rollout.engine.pack_in_place): only the engine's own steps can run it")
            return torch.nn.Linear.forward(layer, x)

        return forward

    def repack(self) -> None:
        """Pack the layers' current weights (after the engine changed them); a released layer keeps
        its packed copy (:meth:`set_weight` changes it)."""
        kept = {i: self._packed[i][0] for i in self.released.values()}
        self._packed = []  # the old copies go before the new ones are made
        with torch.no_grad():
            self._packed = [(kept[i] if i in kept
                             else torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), BATCH_HINT),
                             None if m.bias is None else m.bias.detach().clone())
                            for i, m in enumerate(self.layers)]

    def set_weight(self, name: str, value: torch.Tensor) -> None:
        """The released weight ``name`` packed from ``value`` (the engine's update of it)."""
        i = self.released[name]
        layer = self.layers[i]
        if tuple(value.shape) != tuple(layer.weight.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)}, expected {tuple(layer.weight.shape)}")
        with torch.no_grad():
            dense = value.detach().to("cpu", layer.weight.dtype).contiguous()
            self._packed[i] = (torch.ops.mkldnn._reorder_linear_weight(dense, BATCH_HINT), self._packed[i][1])

    def dense(self, name: str) -> torch.Tensor:
        """The released weight ``name`` as a plain tensor again (a copy)."""
        return self._packed[self.released[name]][0].to_dense()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The layers use their packed copies on this thread until the block ends."""
        self._on.active = True
        try:
            yield
        finally:
            self._on.active = False

    def remove(self) -> None:
        """The layers' own forwards back (released weights restored from their packed copies), the
        packed copies dropped."""
        with torch.no_grad():
            for name, i in self.released.items():
                self.layers[i].weight.data = self.dense(name)
        self.released = {}
        for m in self.layers:
            vars(m).pop("forward", None)
        self._packed = []


def _shared_storages(model: torch.nn.Module) -> set[int]:
    """The storages that more than one parameter slot of ``model`` uses (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        ptr = p.untyped_storage().data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1
    return {ptr for ptr, n in seen.items() if n > 1}


class UnpackedState(Mapping):
    """A state dict whose released weights (:class:`PackedLinears`) read as their packed copies,
    unpacked when asked for: what an adapter's merge takes as the base."""

    def __init__(self, own: Mapping[str, torch.Tensor], packed: PackedLinears) -> None:
        self._own, self._packed = own, packed

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._packed.dense(name) if name in self._packed.released else self._own[name]

    def __iter__(self):
        return iter(self._own)

    def __len__(self) -> int:
        return len(self._own)


def held_state(model: torch.nn.Module, packed: PackedLinears | None) -> Mapping[str, torch.Tensor]:
    """``model``'s weights as its engine holds them: its state dict, the weights ``packed`` released
    read back from their packed copies when asked for."""
    own = model.state_dict()
    return UnpackedState(own, packed) if packed is not None and packed.released else own
