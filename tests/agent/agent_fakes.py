"""Fakes for the agent-loop tests: a recording engine and a small configurable env."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.envs.base import Env, Progress, StepResult, Task

Responder = Callable[[list[int], SamplingParams, int], list[int]]


@dataclass
class Call:
    prompt: list[int]
    params: SamplingParams
    result: GenerationResult


class FakeEngine:
    """Returns scripted token ids (a list served in call order, or a function of the prompt).

    Logprobs are distinct negative numbers; versions come from ``versions_per_call`` (else
    ``self.version``). Output longer than ``params.max_new_tokens`` is cut (finish "length"),
    like a real engine. Every call is recorded in ``self.calls``.
    """

    def __init__(self, script: list[list[int]] | Responder, *, versions_per_call: list[int] | None = None,
                 delay: float = 0.0, fail_on_call: int | None = None, finish_reason: str = "stop") -> None:
        self.script = script
        self.versions_per_call = versions_per_call
        self.delay = delay
        self.fail_on_call = fail_on_call
        self.finish_reason = finish_reason
        self.calls: list[Call] = []
        self._n = 0
        self.version = 0

    def _ids(self, prompt: list[int], params: SamplingParams, k: int) -> list[int]:
        if callable(self.script):
            return list(self.script(prompt, params, k))
        return list(self.script[k])

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        k = self._n
        self._n += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_on_call is not None and k == self.fail_on_call:
            raise EngineError("server went away")
        ids = self._ids(prompt_ids, params, k)
        finish = self.finish_reason
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        v = self.versions_per_call[k] if self.versions_per_call else self.version
        res = GenerationResult(token_ids=ids, logprobs=[-0.1 - 0.01 * i for i in range(len(ids))],
                               finish_reason=finish, versions=[v] * len(ids))
        self.calls.append(Call(list(prompt_ids), params, res))
        return res

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        raise NotImplementedError

    def update_weights(self, weights: Any, version: int) -> None:
        self.version = version

    def stats(self) -> dict[str, float]:
        return {"requests": float(self._n)}

    def close(self) -> None:
        pass


class ToyEnv(Env):
    """Prompt ``"Q<task.data['q']>:"``; each step answers ``"<obs k>"``.

    ``rewards[k]`` is the reward of turn k; the episode is done after ``done_after`` turns (never
    when None), with ``info["success"]`` set then. ``step_sleep`` makes ``step`` block (a slow
    sandbox). ``fail_in`` = "reset" | "step" raises there.
    """

    name = "toy"
    stop_strings = ("</a>",)
    max_turns = 3

    def __init__(self, rewards: list[float] | None = None, done_after: int | None = 2,
                 step_sleep: float = 0.0, fail_in: str | None = None, obs: str = "<obs {k}>\n") -> None:
        super().__init__()
        self.rewards = rewards or [0.0] * 64
        self.done_after = done_after
        self.step_sleep = step_sleep
        self.fail_in = fail_in
        self.obs = obs
        self.actions: list[str] = []
        self.observations: list[str] = []
        self.progress: Progress | None = None
        self.step_times: list[tuple[float, float]] = []

    def generate_tasks(self, split, n, seed):
        return [Task(f"{split}-{seed}-{i}", {"q": i}) for i in range(n)]

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        if self.fail_in == "reset":
            raise KeyError("no such task")
        self.progress = progress
        return f"Q{task.data['q']}:"

    def step(self, action: str) -> StepResult:
        t0 = time.perf_counter()
        if self.fail_in == "step":
            raise ZeroDivisionError("bad env")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        self.actions.append(action)
        k = len(self.actions)
        obs = self.obs.format(k=k)
        self.observations.append(obs)
        done = self.done_after is not None and k >= self.done_after
        self.step_times.append((t0, time.perf_counter()))
        return StepResult(obs, self.rewards[k - 1], done, {"success": done and k == 2} if done else {})

    def demonstration(self, task, rng):
        return [f"think {task.data['q']}</a>", "final answer"]
