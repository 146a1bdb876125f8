"""Inference engines behind one interface (see :mod:`saorl.engines.base`)."""

from saorl.engines.base import EngineError, GenerationResult, InferenceEngine, SamplingParams

__all__ = ["EngineError", "GenerationResult", "InferenceEngine", "SamplingParams"]
