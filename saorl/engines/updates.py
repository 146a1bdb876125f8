"""What :meth:`~saorl.engines.local.LocalEngine.update_weights` is given, made into a state dict in
the model's own names and checked against it before the engine thread sees it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from saorl.models.adapter import AdapterMerger, MergedWeights, is_adapter_dir
from saorl.models.hf_format import FileWeights, read_weights


def update_state(model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | str,
                 adapter: AdapterMerger, base: Mapping[str, torch.Tensor] | None = None
                 ) -> Mapping[str, torch.Tensor]:
    """``weights``: a state dict in the model's own names, a safetensors file of one, a Hugging Face
    directory (checkpoint names, converted by transformers; what the sharded trainer publishes) or a
    LoRA adapter directory, merged into the base by ``adapter`` (:mod:`saorl.models.adapter`).
    A file's tensors are read as the engine applies them (:class:`~saorl.models.hf_format.FileWeights`),
    its names and shapes checked from its header here. ValueError naming the first unknown name or
    wrong shape. ``base``: the model's weights as the engine holds them (default its state dict), what
    an adapter is merged into."""
    if isinstance(weights, str) and is_adapter_dir(weights):
        weights = adapter.merged(model, weights, own=base)
    elif isinstance(weights, str):
        weights = read_weights(weights, like=model)
    own = model.state_dict()  # (a weight an engine packed in place keeps its shape)
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}")
    lazy = isinstance(weights, (FileWeights, MergedWeights))  # read as applied: not here
    for name in weights:
        shape = weights.shape(name) if lazy else tuple(weights[name].shape)
        if shape != tuple(own[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {shape}, expected {tuple(own[name].shape)}"
            )
    return weights
