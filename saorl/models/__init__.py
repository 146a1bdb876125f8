"""Policies, critics and the tokenizer."""

from saorl.models.tiny import TINY_KINDS, build_tiny, tiny_config
from saorl.models.tokenizer import load_tokenizer

__all__ = ["TINY_KINDS", "build_tiny", "load_tokenizer", "tiny_config"]
