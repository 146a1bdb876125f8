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
from collections.abc import Iterator

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
    """Packed copies of ``model``'s float32 CPU ``nn.Linear`` weights (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if _packable(m)]
        self._packed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._on = threading.local()
        self.repack()
        for i, m in enumerate(self.layers):
            m.forward = self._forward_of(m, i)

    def _forward_of(self, layer: torch.nn.Linear, i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if getattr(self._on, "active", False):
                weight, bias = self._packed[i]
                return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
            return torch.nn.Linear.forward(layer, x)

        return forward

    def repack(self) -> None:
        """Pack the layers' current weights (after the engine changed them)."""
        self._packed = []  # the old copies go before the new ones are made
        with torch.no_grad():
            self._packed = [(torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), BATCH_HINT),
                             None if m.bias is None else m.bias.detach().clone()) for m in self.layers]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The layers use their packed copies on this thread until the block ends."""
        self._on.active = True
        try:
            yield
        finally:
            self._on.active = False

    def remove(self) -> None:
        """The layers' own forwards back, the packed copies dropped."""
        for m in self.layers:
            vars(m).pop("forward", None)
        self._packed = []
