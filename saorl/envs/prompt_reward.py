"""``prompt_reward``: your dataset's prompt column and your reward function, as a one-turn env.

The TRL ``GRPOTrainer(reward_funcs=...)`` path without writing an ``Env``: each task is one row
of a dataset (``env.tasks_file`` / ``env.dataset``, see :mod:`saorl.data.tasks`); the prompt is
the row's ``prompt_column``; the policy writes one completion (until eos, ``max_new_tokens``, or
one of the ``stop`` strings); the reward is::

    reward_fn(prompt, completion, **row)        # row = the task's other columns

where ``reward_fn`` is named ``"module.path:function"`` and imported when the env is built (so
a typo fails when the run starts, not in a rollout worker). It must return a finite number;
``info["success"]`` is ``reward >= success_threshold``, which is what evaluation accuracy counts.

Differences from TRL, on purpose: the function is called once per completion with one row's
values (TRL passes batches as lists); the prompt is plain text (no chat messages); and a
return value that is not a finite number (``None``, a string, NaN) is an error naming the
function and the row, never a silent 0.

Demonstrations for the SFT warm start come from a column of the row (``demo_column``, e.g. a
reference solution); without one the env has none, and a run needs ``sft.enabled=false``.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Split, StepResult, Task
from saorl.envs.registry import import_object

_RESERVED = ("prompt", "completion")


class RewardFunctionError(ValueError):
    """A reward function that cannot be used, or that returned something other than a finite number."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """The callable named by ``"module.path:function"``; RewardFunctionError saying what is wrong."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardFunctionError(f"reward_fn must be 'module.path:function', got {spec!r}")
    try:
        fn = import_object(spec, f"reward function {spec!r}")
    except ValueError as e:
        raise RewardFunctionError(f"{e} (is the module on PYTHONPATH, for the rollout workers too?)") from e
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r} is a {type(fn).__name__}, not callable")
    return fn


def _row_text(row: dict[str, Any], limit: int = 160) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[:limit] + "...}"


class PromptRewardEnv(Env):
    name: ClassVar[str] = "prompt_reward"

    def __init__(self, reward_fn: str | None = None, prompt_column: str = "prompt",
                 success_threshold: float = 0.5, stop: Sequence[str] = (), demo_column: str | None = None,
                 **options: Any) -> None:
        """Options: ``reward_fn`` (required, ``module.path:function``), ``prompt_column`` ("prompt"),
        ``success_threshold`` (0.5: success is reward >= it), ``stop`` (strings that end the
        completion, kept in it; default none: eos or ``rollout.max_new_tokens``), ``demo_column``
        (a column holding a demonstration completion, for SFT; default none)."""
        super().__init__(**options)
        if reward_fn is None:
            raise ValueError("reward_fn is required: env.options.reward_fn=module.path:function, a function "
                             "(prompt, completion, **row) -> float")
        if not isinstance(prompt_column, str) or not prompt_column:
            raise ValueError(f"prompt_column must be a non-empty string, got {prompt_column!r}")
        if not isinstance(success_threshold, (int, float)) or not math.isfinite(success_threshold):
            raise ValueError(f"success_threshold must be a finite number, got {success_threshold!r}")
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        if demo_column is not None and (not isinstance(demo_column, str) or not demo_column):
            raise ValueError(f"demo_column must be a column name or null, got {demo_column!r}")
        self.reward_spec, self.fn = reward_fn, load_reward_fn(reward_fn)
        self.prompt_column, self.success_threshold = prompt_column, float(success_threshold)
        self.stop_strings = tuple(stop)  # type: ignore[misc]  # per instance: an option here
        self.demo_column = demo_column
        self.max_turns = 1
        self._task: Task | None = None

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        raise ValueError("prompt_reward has no task generator: give your data with env.tasks_file "
                         "(JSONL, parquet or a datasets directory) or env.dataset.path")

    def _prompt_and_row(self, task: Task) -> tuple[str, dict[str, Any]]:
        if self.prompt_column not in task.data:
            raise ValueError(f"task {task.id!r} has no prompt column {self.prompt_column!r} (columns: "
                             f"{sorted(task.data)}); set env.options.prompt_column")
        prompt = task.data[self.prompt_column]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"task {task.id!r}: prompt column {self.prompt_column!r} must hold non-empty "
                             f"text, got {type(prompt).__name__} {prompt!r:.80}")
        row = {k: v for k, v in task.data.items() if k != self.prompt_column}
        clash = [k for k in _RESERVED if k in row]
        if clash:
            raise ValueError(f"task {task.id!r}: column {clash[0]!r} clashes with the reward function's "
                             f"argument of that name; rename the column")
        return prompt, row

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        self._prompt_and_row(task)
        self._task = task
        return task.data[self.prompt_column]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("PromptRewardEnv.step called before reset (or after the episode ended)")
        task, self._task = self._task, None
        prompt, row = self._prompt_and_row(task)
        completion = self._cut(action)
        where = f"reward function {self.reward_spec!r} on task {task.id!r} (row {_row_text(row)})"
        try:
            value = self.fn(prompt, completion, **row)
        except Exception as e:
            raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e}") from e
        if not isinstance(value, numbers.Real) or not math.isfinite(value):  # bools count as 0 / 1
            raise RewardFunctionError(f"{where} returned {value!r} ({type(value).__name__}); it must "
                                      "return a finite number")
        reward = float(value)
        return StepResult("", reward, True, {"success": reward >= self.success_threshold})

    def _cut(self, action: str) -> str:
        """The completion up to and including the first stop string (engines may run past it)."""
        ends = [action.find(s) + len(s) for s in self.stop_strings if s in action]
        return action[:min(ends)] if ends else action

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The row's ``demo_column`` as the completion (the column must hold text)."""
        if self.demo_column is None:
            raise NotImplementedError("prompt_reward has demonstrations only with env.options.demo_column "
                                      "(a column holding a reference completion); otherwise set "
                                      "sft.enabled=false")
        demo = task.data.get(self.demo_column)
        if not isinstance(demo, str) or not demo:
            raise ValueError(f"task {task.id!r}: demo column {self.demo_column!r} must hold non-empty text, "
                             f"got {demo!r:.80}")
        return [demo]
