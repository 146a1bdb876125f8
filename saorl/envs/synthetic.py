"""``synthetic``: a workload env whose episode lengths follow a configurable long-tailed distribution.

It exists to benchmark the pipeline (``saorl bench pipeline``), not to teach anything useful.
The rollout length, not the task, is the point: RL on agents is slow because a few episodes run
far longer than the rest, and a synchronous batch waits for its longest one.

How the length is imposed. The agent loop takes one ``max_new_tokens`` per run, not per task,
and a randomly initialised tiny model almost never samples EOS, so every turn runs to
``rollout.max_new_tokens`` tokens. The env is therefore multi-turn: each task carries a number of
turns ``n`` drawn from a lognormal with mean ``mean_turns`` and coefficient of variation ``cv``
(σ² = ln(1 + cv²), μ = ln(mean) − σ²/2), rounded and clipped to ``[1, max_turns]``; the episode
ends (``done``) after the ``n``-th action. Action tokens per episode ≈ ``n × max_new_tokens``
(fewer when the policy samples EOS early), so the length distribution in tokens is the turn
distribution scaled. Rounding and the clip move the moments: at the defaults (mean 4, CV 1,
max 24 turns) the mean becomes 3.98 and the CV 0.92 (the clip cuts the tail);
``turns_distribution`` gives the exact discrete probabilities.

Observation between turns: ``"\\n"`` (one token), so nearly every response token is an action.

Reward (learnable but cheap): per turn, the fraction of the action's characters equal to the
task's target character (a letter from ``a..e``, named in the prompt), divided by ``n``, so an
episode's return is in ``[0, 1]``. ``info["success"]`` on the last turn is ``return >= 0.5``.

Tasks are deterministic in ``seed``; the split is part of the random stream's seed and of every
task id (``synthetic-train-17`` / ``synthetic-test-17``), so train and test never share an id.
"""

from __future__ import annotations

import math
import random
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Split, StepResult, Task

TARGET_CHARS = "abcde"


def lognormal_params(mean: float, cv: float) -> tuple[float, float]:
    """``(mu, sigma)`` of the lognormal with the given mean and coefficient of variation."""
    s2 = math.log1p(cv * cv)
    return math.log(mean) - s2 / 2, math.sqrt(s2)


def draw_turns(rng: random.Random, mean: float, cv: float, max_turns: int) -> int:
    """One turn count: a lognormal draw rounded and clipped to ``[1, max_turns]``."""
    mu, sigma = lognormal_params(mean, cv)
    x = rng.lognormvariate(mu, sigma) if sigma > 0 else mean
    return int(min(max_turns, max(1, round(x))))


def turns_distribution(mean: float, cv: float, max_turns: int) -> list[float]:
    """``p[k]`` = probability of ``k`` turns (``p[0] = 0``) after rounding and clipping."""
    mu, sigma = lognormal_params(mean, cv)

    def cdf(x: float) -> float:
        if x <= 0:
            return 0.0
        if sigma == 0:
            return float(mean <= x)
        return 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))

    p = [0.0] * (max_turns + 1)
    for k in range(1, max_turns + 1):
        lo = 0.0 if k == 1 else cdf(k - 0.5)
        hi = 1.0 if k == max_turns else cdf(k + 0.5)
        p[k] = hi - lo
    return p


class SyntheticLengthEnv(Env):
    """Multi-turn env with lognormal episode lengths (in turns); see the module docstring."""

    name: ClassVar[str] = "synthetic"
    stop_strings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, mean_turns: float = 4.0, cv: float = 1.0, max_turns: int = 24, **options: Any) -> None:
        super().__init__(**options)
        if not (isinstance(mean_turns, (int, float)) and mean_turns >= 1):
            raise ValueError(f"mean_turns must be a number >= 1, got {mean_turns!r}")
        if not (isinstance(cv, (int, float)) and cv >= 0):
            raise ValueError(f"cv must be a number >= 0, got {cv!r}")
        if not (isinstance(max_turns, int) and max_turns >= 1):
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.mean_turns, self.cv, self.max_turns = float(mean_turns), float(cv), max_turns
        self._task: Task | None = None
        self._turn = 0
        self._return = 0.0

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"synthetic/{seed}/{split}")
        tasks = []
        for i in range(n):
            turns = draw_turns(rng, self.mean_turns, self.cv, self.max_turns)
            tasks.append(Task(f"synthetic-{split}-{i}", {"turns": turns, "char": rng.choice(TARGET_CHARS)}))
        return tasks

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        turns, char = task.data.get("turns"), task.data.get("char")
        if not (isinstance(turns, int) and turns >= 1) or char not in tuple(TARGET_CHARS):
            raise ValueError(f"synthetic task {task.id!r} needs data turns (int >= 1) and char in "
                             f"{TARGET_CHARS!r}, got {task.data!r}")
        self._task, self._turn, self._return = task, 0, 0.0
        return f"Write {char}:"

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        turns, char = self._task.data["turns"], self._task.data["char"]
        self._turn += 1
        frac = action.count(char) / len(action) if action else 0.0
        reward = frac / turns
        self._return += reward
        done = self._turn >= turns
        info = {"success": self._return >= 0.5, "turn": self._turn} if done else {"turn": self._turn}
        return StepResult("" if done else "\n", reward, done, info)
