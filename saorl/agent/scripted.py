"""A scripted inference engine: "samples" given action strings, for demonstrations and tests.

:class:`ScriptedEngine` implements :class:`~saorl.engines.base.InferenceEngine` by returning the
next of a list of action strings, tokenized canonically as a continuation of the prompt
(:meth:`~saorl.models.codec.RunTokenizer.continuation_ids`: ``encode(action)`` for byte-level
tokenizers, without the dummy prefix space for SentencePiece ones), with logprob 0.0 and the
configured version on every token. It ignores the prompt and the sampling temperature.
Running it through :func:`saorl.agent.loop.run_episode` turns an env's demonstration into a
trajectory for SFT with the very same loop (same masks, same observation handling) as RL.

Ending a turn: a real policy ends a turn on a stop string or on eos. An action that does not
end with one of the request's stop strings gets the eos token appended (``finish_reason
"stop"``, ``stop_reason`` the eos id), so SFT teaches the model to stop there. An action longer
than ``max_new_tokens`` is cut (``finish_reason "length"``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch

from saorl.agent.loop import run_episode
from saorl.data.task import Task
from saorl.data.trajectory import Trajectory
from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.envs.base import Env
from saorl.models.codec import as_run_tokenizer


class ScriptedEngine:
    """Returns ``actions`` one per request, in order; :class:`EngineError` once they run out."""

    def __init__(self, tokenizer: Any, actions: Iterable[str], *, version: int = 0,
                 append_eos: bool = True) -> None:
        self.tokenizer = tokenizer
        self._actions = list(actions)
        self._next = 0
        self._version = version
        self.append_eos = append_eos
        self.requests: list[list[int]] = []
        """Every prompt received, for tests and debugging."""

    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, float]:
        return {"requests": float(self._next)}

    @property
    def remaining(self) -> int:
        return len(self._actions) - self._next

    def _next_result(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if self._next >= len(self._actions):
            raise EngineError(f"scripted engine ran out of actions after {len(self._actions)}")
        action = self._actions[self._next]
        self._next += 1
        self.requests.append(list(prompt_ids))
        ids = as_run_tokenizer(self.tokenizer).continuation_ids(list(prompt_ids), action)
        stop = next((s for s in params.stop if action.endswith(s)), None)
        eos = self.tokenizer.eos_token_id
        stop_reason: str | int | None = stop
        if stop is None and self.append_eos and eos is not None:
            ids.append(eos)
            stop_reason = eos
        finish = "stop" if stop_reason is not None else "length"
        if len(ids) > params.max_new_tokens:
            ids, finish, stop_reason = ids[: params.max_new_tokens], "length", None
        return GenerationResult(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish,
                                versions=[self._version] * len(ids), stop_reason=stop_reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        return [self._next_result(p, params) for p in prompts]

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        return self._next_result(prompt_ids, params)

    def update_weights(self, weights: dict[str, torch.Tensor] | str, version: int) -> None:
        """Only the version changes: scripted actions do not depend on weights."""
        self._version = version

    def close(self) -> None:
        pass


async def demonstration_trajectory(env: Env, task: Task, tokenizer: Any, rng: random.Random, *,
                                   max_total_tokens: int = 4096, version: int = 0) -> Trajectory:
    """Play ``env.demonstration(task, rng)`` through the agent loop → an SFT trajectory.

    Every action token has logprob 0.0 and ``version``; ``env`` must be fresh. The episode runs
    for at most as many turns as the demonstration has actions (``truncated`` if the env was not
    done by then); ``metadata["demonstration"]`` is True.
    """
    actions = list(env.demonstration(task, rng))
    if not actions:
        raise ValueError(f"env {env.name!r} gave an empty demonstration for task {task.id!r}")
    engine = ScriptedEngine(tokenizer, actions, version=version)
    longest = max(len(tokenizer.encode(a, add_special_tokens=False)) for a in actions) + 2  # + eos, a prefix
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max(1, longest))
    traj = await run_episode(engine, env, task, tokenizer, sampling=sampling, max_turns=len(actions),
                             max_total_tokens=max_total_tokens)
    traj.metadata["demonstration"] = True
    return traj
