"""Tiny policies built offline from a config: the models every CPU test and preset uses.

``tiny-moe``: Qwen3-MoE, hidden 128, 4 layers, 8 experts, top-2 (~1.9M parameters).
``tiny-dense``: Qwen3, hidden 128, 4 layers (~1.0M parameters).
Experts use ``grouped_mm`` (``batched_mm`` is ~50× slower on CPU).
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from saorl.models.source import TINY_KINDS
from saorl.models.tokenizer import VOCAB_SIZE

TinyKind = Literal["tiny-moe", "tiny-dense"]

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=True, eos_token_id=0, pad_token_id=1, bos_token_id=None,
)


def tiny_config(kind: TinyKind = "tiny-moe", **overrides):
    if kind == "tiny-moe":
        cfg = dict(_COMMON, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=True, experts_implementation="grouped_mm")
        cfg.update(overrides)
        return Qwen3MoeConfig(**cfg)
    if kind == "tiny-dense":
        cfg = dict(_COMMON, intermediate_size=384)
        cfg.update(overrides)
        return Qwen3Config(**cfg)
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")


def build_tiny(kind: TinyKind = "tiny-moe", seed: int = 0, **overrides) -> PreTrainedModel:
    """A freshly initialised tiny causal LM (deterministic in ``seed``)."""
    cfg = tiny_config(kind, **overrides)
    cls = Qwen3MoeForCausalLM if kind == "tiny-moe" else Qwen3ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.eval()
