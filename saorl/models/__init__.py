"""Policies, critics and the tokenizer."""

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
from saorl.models.tiny import TINY_KINDS, build_tiny, tiny_config
from saorl.models.tokenizer import load_tokenizer

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
