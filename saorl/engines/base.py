"""The inference-engine seam: token ids in, sampled token ids and their logprobs out.

Every engine (the local torch engine, the HTTP client that drives ``saorl serve``, vLLM or
SGLang) implements :class:`InferenceEngine`. The contract that DIS relies on:
``GenerationResult.logprobs[i]`` is log p(token_ids[i]) under the distribution the token was
*actually sampled from* (after temperature / top-k / top-p), and ``versions[i]`` is the weight
version that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from saorl.config.sections import RolloutConfig

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy; logprobs are then those of the untempered distribution."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends on the first token whose decoded text completes one.
    The sampled tokens are kept as sampled (the last one may run past the stop string)."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    """Also return, per generated token, this many most likely alternatives of the distribution
    it was sampled from (``GenerationResult.top_logprobs``); 0 = none."""
    session: str | None = None
    """Episode id for prefix reuse (a saorl extension): the local engine keeps the KV cache of a
    finished request of this session, and when the session's next request extends those tokens
    it prefills only the new ones. Engines without it ignore the field."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")

    @classmethod
    def of_rollout(cls, rollout: RolloutConfig, temperature: float | None = None) -> SamplingParams:
        """A run's sampling settings (its ``rollout`` section; ``temperature`` None: the rollout's)."""
        return cls(temperature=rollout.temperature if temperature is None else temperature,
                   top_p=rollout.top_p, top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens)


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int]
    """Weight version per generated token (a request can span a weight update)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended generation, if any."""
    metrics: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``SamplingParams.top_logprobs = k``: per generated token, the k most likely
    ``(token id, log-prob)`` of its sampling distribution, most likely first."""
    routes: list[list[int]] | None = None
    """From an engine that records MoE routing: for every position it fed to the model — the
    prompt, then each generated token but the last — the experts it routed that position to in
    every MoE layer, flattened ``layers × k`` (``saorl.models.routing``)."""


class EngineError(RuntimeError):
    """The engine could not serve a request (server died, timed out, bad response)."""


@runtime_checkable
class InferenceEngine(Protocol):
    @property
    def version(self) -> int: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """Blocking batched generation, one result per prompt, in order."""
        ...

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One request; many may be awaited concurrently (continuous batching batches them)."""
        ...

    def update_weights(self, weights: dict[str, torch.Tensor] | str, version: int) -> None:
        """Load new policy weights (a state dict or the path of a safetensors file) tagged with
        ``version``. A path is read by the engine itself (its server, for a remote one)."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since construction (requests, tokens; the local engine adds decode steps,
        busy slots and seconds per phase). The run reads ``decode_steps`` and ``busy_slot_steps``
        when present."""
        ...

    def close(self) -> None: ...
