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

Top layers only (``critic_train_layers = N``, a departure from the paper, default off): only the
top N transformer blocks train (their MLP projections under frozen attention, else the whole
blocks and the final norm), with the value head; the blocks below are frozen entirely. Their
output then cannot change during a trainer step, so it is computed once per batch under
``no_grad`` (:meth:`Critic.frozen_hidden`) and every pass of the step (the values, the K updates)
runs only the top blocks from it (``forward(..., lower=...)``): the same numbers as the whole
trunk, for the top blocks' cost. The trunk runs one part at a time by standing a pass-through in
for the blocks outside it (and, below the boundary, for the final norm), so the model's own
``forward`` still builds the masks, rotary tables and packed-attention arguments every block gets.
Needs a trunk with a ``layers`` module list and a final ``norm`` (Llama, Qwen, Gemma families); a
LoRA critic is refused (its adapter spans every layer).

Value head init: weight ~ N(0, 1/(hidden+1)²), bias 0 (as in OpenRLHF). Small, so initial values
are near 0, but not zero, so the trunk gets gradient from the very first step.
"""

from __future__ import annotations

import contextlib
import copy
import re

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from saorl.models.loading import ensure_cpu_experts, load_policy, resolve_dtype
from saorl.models.packed import model_inputs, require_shared_prefix_support

# Parameters that stay trainable under frozen attention: fused MoE experts, dense (or shared
# expert) MLP projections. `mlp.gate.weight` (the router) deliberately does not match.
_MLP_TRAINABLE = re.compile(
    r"(^|\.)mlp\.(experts\.(gate_up_proj|down_proj)(_bias)?"
    r"|(.+\.)?(gate_proj|up_proj|down_proj)\.(weight|bias))$"
)


class _PassThrough(nn.Module):
    """Stands in for a decoder block (or the final norm) that a partial pass skips."""

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        return hidden_states


def trunk_blocks(trunk: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a critic's trunk (its ``layers`` module list)."""
    layers = getattr(trunk, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(getattr(trunk, "norm", None), nn.Module):
        raise ValueError(f"critic_train_layers needs a trunk with a `layers` module list and a final `norm` "
                         f"(Llama, Qwen, Gemma families); {type(trunk).__name__} has "
                         f"{'no such list' if not isinstance(layers, nn.ModuleList) else 'no `norm`'}")
    return layers


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
        self.train_layers: int | None = None
        """Only the top this many blocks train, the frozen ones below run once per batch (module
        docstring); None: every block (set by :meth:`set_frozen_attention`)."""
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
                cu_seqlens: Tensor | None = None, lower: Tensor | None = None,
                lower_only: bool = False) -> Tensor:
        """``values [B, T]`` float32: ``values[:, t] = head(hidden[:, t-1])``.

        Right or left padding (position ids come from the mask), or a packed row ``[1, N]``
        (``attention_mask=None``, per-sequence ``position_ids`` and ``cu_seqlens``, see
        :func:`saorl.models.packed.model_inputs`). 0 at t = 0, at padding, and wherever token t-1
        is padding or another sequence's. Value at t depends only on tokens ``< t`` of its sequence.

        With :attr:`train_layers` set, the frozen blocks below the trained ones run under
        ``no_grad``; ``lower`` (``[B, T, H]``, from :meth:`frozen_hidden` on the same inputs) is their
        output reused instead of recomputed, and ``lower_only`` returns that output (what
        :meth:`frozen_hidden` calls: a call of the module itself, so hooks around it run).
        """
        kwargs, scored = model_inputs(input_ids, attention_mask, position_ids, cu_seqlens)
        require_shared_prefix_support(self.trunk, kwargs)
        if self.train_layers is None:
            if lower is not None or lower_only:
                raise ValueError("a critic whose every block trains has no frozen lower part "
                                 "(set_frozen_attention(..., layers=N) first)")
            hidden = self.trunk(**kwargs).last_hidden_state
        else:
            if lower is None:
                with torch.no_grad(), self._running(top=False):
                    lower = self.trunk(**kwargs).last_hidden_state
            if lower_only:
                return lower
            kwargs.pop("input_ids")
            with self._running(top=True):
                hidden = self.trunk(inputs_embeds=lower, **kwargs).last_hidden_state
        v = self.value_head(hidden[:, :-1].to(self.value_head.weight.dtype)).squeeze(-1)  # [B, T-1]
        values = torch.cat([v.new_zeros(input_ids.shape[0], 1), v], dim=1)
        return torch.where(scored, values, v.new_zeros(()))

    def frozen_hidden(self, input_ids: Tensor, attention_mask: Tensor | None, *,
                      position_ids: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor | None:
        """The frozen lower blocks' output ``[B, T, H]`` (no gradient) for ``forward(..., lower=)``;
        None when every block trains (nothing below to reuse)."""
        if self.train_layers is None:
            return None
        with torch.no_grad():
            return self(input_ids, attention_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
                        lower_only=True)

    @contextlib.contextmanager
    def _running(self, *, top: bool):
        """The trunk with only the top :attr:`train_layers` blocks (``top``; then from the input
        embeddings it is given) or only the blocks below them and no final norm."""
        layers = trunk_blocks(self.trunk)
        cut = len(layers) - self.train_layers
        skip = _PassThrough()
        part = nn.ModuleList([b if (i >= cut) == top else skip for i, b in enumerate(layers)])
        norm = self.trunk.norm
        self.trunk._modules["layers"] = part
        if not top:
            self.trunk._modules["norm"] = skip
        try:
            yield
        finally:
            self.trunk._modules["layers"] = layers
            self.trunk._modules["norm"] = norm

    def set_frozen_attention(self, enabled: bool, layers: int | None = None) -> list[str]:
        """Freeze everything but the MLP / expert projections and the value head (or unfreeze all);
        with ``layers`` (``algo.critic_train_layers``), only the top ``layers`` blocks' part of that
        trains (with the final norm when attention is not frozen) and every block below is frozen.

        Returns the names of the trainable parameters afterwards. Raises if ``enabled`` and the
        trunk has no parameter recognised as an MLP projection (an unknown architecture), and if
        ``layers`` is not in [1, the trunk's blocks]. A LoRA critic (:attr:`lora`) trains its
        adapter and the value head whatever ``enabled`` says: its trunk's own weights, attention
        and MLP alike, stay frozen under the adapter; it takes no ``layers``.
        """
        if self.lora:
            if layers is not None:
                raise ValueError(f"algo.critic_train_layers={layers} does not combine with a LoRA critic "
                                 "(model.lora.critic: its adapter spans every layer); set one of them")
            return self._freeze_all_but_adapter()
        top = self._top_blocks(layers)
        trainable = []
        for name, p in self.named_parameters():
            train = (not enabled) or name.startswith("value_head.") or bool(_MLP_TRAINABLE.search(name))
            if layers is not None and not name.startswith("value_head."):
                top_norm = not enabled and name.startswith("trunk.norm.")
                train = train and (top_norm or id(p) in top)
            p.requires_grad_(train)
            if train:
                trainable.append(name)
        if enabled and all(n.startswith("value_head.") for n in trainable):
            raise ValueError(
                f"frozen attention found no MLP/expert projection in {type(self.trunk).__name__}; "
                "expected parameters named like 'mlp.experts.gate_up_proj' or 'mlp.up_proj.weight'"
            )
        self.train_layers = layers
        return trainable

    def _top_blocks(self, layers: int | None) -> set[int]:
        """Ids of the parameters of the top ``layers`` blocks (after checking the count)."""
        if layers is None:
            return set()
        blocks = trunk_blocks(self.trunk)
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= len(blocks):
            raise ValueError(f"algo.critic_train_layers must be in [1, {len(blocks)}] (the critic's trunk, "
                             f"{type(self.trunk).__name__}, has {len(blocks)} blocks), got {layers!r}")
        return {id(p) for b in blocks[len(blocks) - layers:] for p in b.parameters()}

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
