"""The critic: the policy's transformer trunk (no LM head) plus a scalar value head.

``values[:, t] = V(s_t)``, the estimate for the state *before* token t is emitted, read from the
trunk's final hidden state at position t-1 (docs/method.md). ``values[:, 0] = 0``, and like
``token_logprobs`` a position holds 0 unless token t and token t-1 are both real.

Frozen attention (docs/method.md, the default for critic training): only the MLP / MoE expert
projections and the value head train. Frozen: attention projections, q/k norms, layer norms,
the final norm, embeddings — and the MoE router (``mlp.gate``). The router is not an expert
projection, and freezing it keeps the critic routing tokens to the experts the policy does, so
the trainable part is exactly "the MLP weights". A shared expert's ``gate/up/down_proj`` trains;
its scalar ``shared_expert_gate`` does not.

Value head init: weight ~ N(0, 1/(hidden+1)²), bias 0 (as in OpenRLHF). Small, so initial values
are near 0, but not zero, so the trunk gets gradient from the very first step.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from saorl.models.loading import ensure_cpu_experts, load_policy, resolve_dtype
from saorl.models.packed import model_inputs

# Parameters that stay trainable under frozen attention: fused MoE experts, dense (or shared
# expert) MLP projections. `mlp.gate.weight` (the router) deliberately does not match.
_MLP_TRAINABLE = re.compile(
    r"(^|\.)mlp\.(experts\.(gate_up_proj|down_proj)(_bias)?"
    r"|(.+\.)?(gate_proj|up_proj|down_proj)\.(weight|bias))$"
)


def policy_trunk(policy: PreTrainedModel) -> PreTrainedModel:
    """The base model of a causal LM (``policy.model`` for Llama/Qwen-style models)."""
    trunk = getattr(policy, "base_model", None)
    if trunk is None or trunk is policy:
        raise TypeError(
            f"{type(policy).__name__} has no separate base model (expected e.g. `.model` under the LM head)"
        )
    return trunk


class Critic(nn.Module):
    """A value model ``V(s_t)`` on top of a causal-LM trunk.

    Attributes:
        trunk: the base transformer (``PreTrainedModel``, e.g. ``Qwen3MoeModel``) — its config is
            what ``save_critic`` writes as ``config.json``.
        value_head: ``Linear(hidden_size, 1)``, float32.
    """

    def __init__(self, trunk: PreTrainedModel, head_init_std: float | None = None, seed: int = 0):
        super().__init__()
        hidden = trunk.config.hidden_size
        self.trunk = trunk
        self.lora = False
        """Whether the trunk carries a LoRA adapter (:func:`saorl.models.lora.attach_critic_lora`):
        then only the adapter and the value head train, the trunk's own weights stay frozen."""
        self.value_head = nn.Linear(hidden, 1)
        std = 1.0 / (hidden + 1) if head_init_std is None else head_init_std
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(1, hidden, generator=gen) * std)
            self.value_head.bias.zero_()
        p = next(trunk.parameters())
        self.value_head.to(device=p.device)

    @classmethod
    def from_policy(
        cls, policy_or_spec: PreTrainedModel | str, *, dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None, seed: int = 0, head_init_std: float | None = None,
    ) -> Critic:
        """A critic whose trunk is a deep copy of the policy's (or of ``load_policy(spec)``'s) trunk.

        ``dtype``/``device`` default to the policy's. The policy itself is left untouched.
        """
        if isinstance(policy_or_spec, str):
            policy = load_policy(policy_or_spec, dtype=dtype or "float32", device=device or "cpu", seed=seed)
            trunk = policy_trunk(policy)
        else:
            trunk = copy.deepcopy(policy_trunk(policy_or_spec))
            if dtype is not None:
                trunk = trunk.to(dtype=resolve_dtype(dtype))
            if device is not None:
                trunk = trunk.to(device=device)
        trunk_device = next(trunk.parameters()).device
        trunk = ensure_cpu_experts(trunk, trunk_device)
        trunk.train()
        for p in trunk.parameters():
            p.requires_grad_(True)
        return cls(trunk, head_init_std=head_init_std, seed=seed)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, *, position_ids: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``values [B, T]`` float32: ``values[:, t] = head(hidden[:, t-1])``.

        Right or left padding (position ids come from the mask), or a packed row ``[1, N]``
        (``attention_mask=None``, per-sequence ``position_ids`` and ``cu_seqlens``, see
        :func:`saorl.models.packed.model_inputs`). 0 at t = 0, at padding, and wherever token t-1
        is padding or another sequence's. Value at t depends only on tokens ``< t`` of its sequence.
        """
        kwargs, scored = model_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
        out = self.trunk(**kwargs)
        hidden = out.last_hidden_state[:, :-1]  # [B, T-1, H]
        v = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # [B, T-1]
        values = torch.cat([v.new_zeros(input_ids.shape[0], 1), v], dim=1)
        return torch.where(scored, values, v.new_zeros(()))

    def set_frozen_attention(self, enabled: bool) -> list[str]:
        """Freeze everything but the MLP / expert projections and the value head (or unfreeze all).

        Returns the names of the trainable parameters afterwards. Raises if ``enabled`` and the
        trunk has no parameter recognised as an MLP projection (an unknown architecture). A LoRA
        critic (:attr:`lora`) trains its adapter and the value head whatever ``enabled`` says: its
        trunk's own weights, attention and MLP alike, stay frozen under the adapter.
        """
        if self.lora:
            return self._freeze_all_but_adapter()
        trainable = []
        for name, p in self.named_parameters():
            train = (not enabled) or name.startswith("value_head.") or bool(_MLP_TRAINABLE.search(name))
            p.requires_grad_(train)
            if train:
                trainable.append(name)
        if enabled and all(n.startswith("value_head.") for n in trainable):
            raise ValueError(
                f"frozen attention found no MLP/expert projection in {type(self.trunk).__name__}; "
                "expected parameters named like 'mlp.experts.gate_up_proj' or 'mlp.up_proj.weight'"
            )
        return trainable

    def _freeze_all_but_adapter(self) -> list[str]:
        trainable = []
        for name, p in self.named_parameters():
            train = name.startswith("value_head.") or ".lora_A." in name or ".lora_B." in name
            p.requires_grad_(train)
            if train:
                trainable.append(name)
        return trainable

    def merged(self) -> Critic:
        """A plain copy of a LoRA critic: the adapter merged into its trunk's weights (``W + s·B·A``)
        and each adapter module replaced by its base layer; the critic itself is left as it is."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        out = copy.deepcopy(self)
        layers = [(n, m) for n, m in out.trunk.named_modules() if isinstance(m, BaseTunerLayer)]
        for name, layer in layers:
            layer.merge()
            parent, _, child = name.rpartition(".")
            setattr(out.trunk.get_submodule(parent), child, layer.get_base_layer())
        out.lora = False
        for p in out.parameters():
            p.requires_grad_(True)
        return out

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters with ``requires_grad`` (what the critic optimizer should hold)."""
        return [p for p in self.parameters() if p.requires_grad]
