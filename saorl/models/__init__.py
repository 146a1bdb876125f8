"""Policies, critics and the tokenizer.

The names below are imported on first use (PEP 562), so that ``saorl.models.source`` (what a model
spec names: no torch) can be used by config loading without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "Critic": "critic",
    "build_tiny": "tiny",
    "export_policy": "serialize",
    "load_critic": "serialize",
    "load_policy": "loading",
    "load_safetensors": "serialize",
    "load_tokenizer": "tokenizer",
    "save_critic": "serialize",
    "save_safetensors_atomic": "serialize",
    "TINY_KINDS": "source",
    "tiny_config": "tiny",
    "token_logprobs": "logprobs",
}

__all__ = [
    "TINY_KINDS",
    "Critic",
    "build_tiny",
    "export_policy",
    "load_critic",
    "load_policy",
    "load_safetensors",
    "load_tokenizer",
    "save_critic",
    "save_safetensors_atomic",
    "tiny_config",
    "token_logprobs",
]

if TYPE_CHECKING:
    from saorl.models.critic import Critic
    from saorl.models.loading import load_policy
    from saorl.models.logprobs import token_logprobs
    from saorl.models.serialize import (
        export_policy,
        load_critic,
        load_safetensors,
        save_critic,
        save_safetensors_atomic,
    )
    from saorl.models.source import TINY_KINDS
    from saorl.models.tiny import build_tiny, tiny_config
    from saorl.models.tokenizer import load_tokenizer


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'saorl.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"saorl.models.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
