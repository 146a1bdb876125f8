"""What :meth:`~saorl.engines.local.LocalEngine.update_weights` is given, made into a state dict in
the model's own names and checked against it before the engine thread sees it."""

from __future__ import annotations

import torch

from saorl.models.adapter import AdapterMerger, is_adapter_dir


def update_state(model: torch.nn.Module, weights: dict[str, torch.Tensor] | str,
                 adapter: AdapterMerger) -> dict[str, torch.Tensor]:
    """``weights``: a state dict in the model's own names, a safetensors file of one, a Hugging Face
    directory (checkpoint names, converted by transformers; what the sharded trainer publishes) or a
    LoRA adapter directory, merged into the base by ``adapter`` (:mod:`saorl.models.adapter`).
    ValueError naming the first unknown name or wrong shape."""
    if isinstance(weights, str) and is_adapter_dir(weights):
        weights = adapter.merged(model, weights)
    elif isinstance(weights, str):
        from saorl.models.hf_format import read_weights

        weights = read_weights(weights, like=model)
    own = model.state_dict()
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(own[name].shape)}"
            )
    return weights
