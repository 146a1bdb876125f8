"""``saorl serve``: the server behind vLLM 0.32's OpenAI-compatible API over any InferenceEngine,
its request and response schemas, limits, metrics, streams and its emulations of vLLM / SGLang routes."""
