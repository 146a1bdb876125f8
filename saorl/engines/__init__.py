"""Inference engines behind one interface (see :mod:`saorl.engines.base`)."""

from saorl.engines.base import EngineError, GenerationResult, InferenceEngine, SamplingParams
from saorl.engines.clients.http_client import HttpEngine
from saorl.engines.local import LocalEngine

__all__ = [
    "EngineError",
    "GenerationResult",
    "HttpEngine",
    "InferenceEngine",
    "LocalEngine",
    "SamplingParams",
]
