"""MoE routing, made explicit: perturb it on the rollout side, record it, replay it in the trainer.

A Qwen3-MoE-style layer routes each token with ``mlp.gate`` (a top-k router): logits
``z = W h``, probabilities ``p = softmax(z)``, experts ``E = topk(p, k)``, weights
``w = p[E]`` (renormalised over ``E`` when ``norm_topk_prob``). Here every router of a model
gets one forward that does exactly that by default, plus three switches:

- **perturbation** (:func:`perturb_routing`, the rollout engine only): pick ``k'`` experts instead
  of ``k`` and/or pick them from noisy logits ``z + σ·ε``. The weights are always the router's
  own probabilities of the picked experts, so the perturbation changes *which* experts run,
  never how the picked ones are weighted. This is the engine/trainer mismatch that a separate
  inference engine with its own kernels and routing produces at scale, made dialable on a CPU.
- **recording** (:func:`record_routes`): the experts each position was routed to, per layer.
- **replay** (:func:`replay_routes`, R3 "rollout routing replay"): route each position to the
  recorded experts instead of recomputing them; the weights still come from the current router,
  so gradients reach it as usual. Positions recorded as ``-1`` (never seen by the engine: the
  last sampled token, padding) are routed as usual.

With the engine's perturbation recorded and replayed, the trainer computes the engine's very
forward: the log-probs agree to float round-off (a perturbation by noise included, because noise
only ever changes the choice).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class _Routing:
    """Per-router switches (one shared object for all routers of a model)."""

    top_k: int | None = None
    noise_std: float = 0.0
    generator: torch.Generator | None = None
    record: list[list[Tensor]] | None = None
    """When set, each layer appends the ``[N, k]`` experts it picked, per forward."""
    forced: Tensor | None = None
    """``[N, L, k]`` experts to use (``-1``: route as usual), N = the forward's flattened positions."""
    layer_of: dict[int, int] = field(default_factory=dict)


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers (``...mlp.gate`` with ``top_k``/``num_experts``) in layer order; [] if dense."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


def _state(model: nn.Module) -> _Routing:
    """The model's routing switches, installing the explicit router forward on first use."""
    state = getattr(model, "_saorl_routing", None)
    if state is not None:
        return state
    gates = routers(model)
    if not gates:
        raise ValueError(f"{type(model).__name__} has no top-k MoE routers (mlp.gate) to perturb, record "
                         "or replay; routing options need a Qwen3-MoE-style model")
    state = _Routing()
    for layer, gate in enumerate(gates):
        state.layer_of[id(gate)] = layer
        gate.forward = types.MethodType(_make_forward(state), gate)
    model._saorl_routing = state
    return state


def _make_forward(state: _Routing):
    def forward(gate: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = hidden_states.reshape(-1, gate.weight.shape[1])
        logits = F.linear(hidden, gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        k = state.top_k or gate.top_k
        if state.noise_std > 0:
            noise = torch.randn(logits.shape, generator=state.generator, dtype=torch.float)
            picked = torch.topk(logits.float() + state.noise_std * noise.to(logits.device), k, dim=-1).indices
        else:
            picked = torch.topk(probs, k, dim=-1).indices
        layer = state.layer_of[id(gate)]
        if state.forced is not None:
            forced = state.forced[:, layer].to(picked.device)
            if forced.shape[0] != picked.shape[0]:
                raise ValueError(f"replayed routes cover {forced.shape[0]} positions, the forward has "
                                 f"{picked.shape[0]}")
            natural = torch.topk(probs, forced.shape[-1], dim=-1).indices
            picked = torch.where(forced >= 0, forced, natural)
        weights = probs.gather(-1, picked)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if state.record is not None:
            state.record[layer].append(picked.detach())
        return logits, weights.to(logits.dtype), picked

    return forward


def perturb_routing(model: nn.Module, *, top_k: int | None = None, noise_std: float = 0.0,
                    seed: int = 0) -> None:
    """Route ``model`` with ``top_k`` experts and/or from logits plus N(0, ``noise_std``²) noise.

    ``top_k=None`` keeps the model's own; ``noise_std=0`` and ``top_k=None`` undo the perturbation.
    """
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    state = _state(model)
    experts = routers(model)[0].num_experts
    if top_k is not None and top_k > experts:
        raise ValueError(f"top_k={top_k} is more than the model's {experts} experts")
    state.top_k, state.noise_std = top_k, float(noise_std)
    state.generator = torch.Generator().manual_seed(seed) if noise_std > 0 else None


@contextmanager
def record_routes(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Within the block, every forward's routes: ``out[layer]`` is a list of ``[N, k]`` tensors,
    one per forward call, N = that call's flattened positions (batch × sequence)."""
    state = _state(model)
    out: list[list[Tensor]] = [[] for _ in routers(model)]
    state.record = out
    try:
        yield out
    finally:
        state.record = None


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor) -> Iterator[None]:
    """Within the block, a forward on ``[B, T]`` tokens routes position ``(b, t)`` of layer ``l``
    to ``routes[b, t, l]`` (``[B, T, L, k]`` long; ``-1`` = route as usual)."""
    state = _state(model)
    if routes.dim() != 4 or routes.shape[2] != len(routers(model)):
        raise ValueError(f"routes must be [B, T, layers={len(routers(model))}, k], got {tuple(routes.shape)}")
    state.forced = routes.reshape(-1, routes.shape[2], routes.shape[3]).long()
    try:
        yield
    finally:
        state.forced = None


def num_experts(model: nn.Module) -> int:
    """Experts each MoE layer routes over (the first router's; 0 for a dense model)."""
    gates = routers(model)
    return int(gates[0].num_experts) if gates else 0


def num_moe_layers(model: nn.Module) -> int:
    """How many MoE layers route tokens (0 for a dense model)."""
    return len(routers(model))
