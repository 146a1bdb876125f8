"""The environment protocol: text in / text out for the env author, token-exact for the trainer.

An :class:`Env` instance runs one episode at a time (the agent loop makes a fresh instance per
episode, so ``__init__`` must be cheap). The loop is::

    prompt = env.reset(task, progress)          # first observation
    while True:
        action = <policy samples text until one of env.stop_strings>
        result = env.step(action)               # observation, reward, done, info
        if result.done: break

The agent loop (``saorl.agent``) turns this into token ids without ever re-tokenizing earlier
text; env authors never see tokens. Rewards may be given at every turn. The final
``StepResult.info["success"]`` (bool) is what evaluation accuracy counts; an optional final
``info["metrics"]`` (names → finite numbers) is kept on the episode (``Episode.env_metrics``) and
logged as batch means, ``env/<name>`` per trainer step and ``eval/env/<name>`` per evaluation.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from saorl.data.task import Task

Split = Literal["train", "test"]

__all__ = ["Env", "Progress", "Split", "StepResult", "Task"]


@dataclass(frozen=True)
class Progress:
    """Where training is, for envs whose reward moves with it (``style_shift``)."""

    trainer_step: int = 0
    episode: int = 0


@dataclass
class StepResult:
    observation: str
    """Text the environment appends after the action ('' for none)."""
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    name: ClassVar[str] = "env"
    stop_strings: ClassVar[tuple[str, ...]] = ()
    """Strings that end one action turn (e.g. '</tool>', '</answer>')."""
    version: ClassVar[int] = 1
    """Bump when the env's prompts, observations, rewards or demonstrations change: the cached SFT
    warm starts and pretrained critics are keyed on it, so they are rebuilt, not reused stale."""
    max_turns: int = 4

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options: {sorted(options)}")

    @abstractmethod
    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """Deterministic in ``seed``; train and test task ids never overlap."""

    @abstractmethod
    def reset(self, task: Task, progress: Progress | None = None) -> str:
        """Start an episode and return the prompt text."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action (the decoded text the policy sampled this turn)."""

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Actions of a (sometimes deliberately suboptimal) demonstration for SFT."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations")
