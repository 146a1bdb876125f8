"""``prompt_reward``: your dataset's prompt column and your reward function(s), as a one-turn env.

The TRL ``GRPOTrainer(reward_funcs=...)`` path without writing an ``Env``: each task is one row
of a dataset (``env.tasks_file`` / ``env.dataset``, see :mod:`saorl.data.tasks`); the prompt is
the row's ``prompt_column``; the policy writes one completion (until eos, ``max_new_tokens``, or
one of the ``stop`` strings); the reward comes from the functions named in ``reward_fn``
(``"module.path:function"`` or a list of them), each called per completion,
``fn(prompt, completion, **row)``, or TRL-style with lists, ``fn(prompts=[...],
completions=[...], completion_ids=[...], **columns)`` (:mod:`saorl.envs.reward_funcs` has the
rule that tells them apart, the weighted sum of ``reward_weights``, what None means, and the
per-function metrics). They are imported when the env is built, so a typo fails when the run
starts, not in a rollout worker. ``info["success"]`` is ``reward >= success_threshold``, which is
what evaluation accuracy counts.

Prompts, as TRL takes them: text (a non-empty string), or a conversation, a list of ``{"role",
"content"}`` messages (TRL's conversational format and verl's parquet ``prompt`` column; a system
message included). ``reset`` returns either, and the run's tokenizer renders it
(:meth:`saorl.models.codec.RunTokenizer.prompt_ids`): a conversation always through the model's
chat template, with the generation prompt after it. The reward functions get the prompt as the
row holds it (the messages for a conversation) and, for a conversation, the completion as TRL
passes it, ``[{"role": "assistant", "content": text}]``; for text prompts, the text. Keys of a
message that hold None (a field some messages of a parquet column lack reads back as None) are
dropped; a message without a role, with content that is not text (multimodal parts), or an empty
conversation is an error naming the task, which the start-up check names by file and row.

With tools (``env.tools``: :mod:`saorl.agent.tool_turns`) an episode runs several turns: the
model's tool calls are run and answered as ``tool`` messages until it replies without a call (or
at ``env.tool_max_turns``), and that reply is what ``step`` scores. The reward functions get as the
completion the whole conversation after the prompt, as TRL passes it when it runs tools: each
calling turn as ``{"role": "assistant", "content", "tool_calls"}``, each result as ``{"role":
"tool", "name", "content"}``, the final reply last — for a text prompt too (the episode was a
conversation). ``completion_ids`` are the final reply's ids.

The reward function is user code, so a run calls it under a deadline (``env.call_timeout_s``,
:mod:`saorl.envs.hosted`): ``reset`` and ``step`` run in a warm child process, killed when a call
runs past it, and the timeout's message names the function, the task and its row
(:meth:`PromptRewardEnv.call_site`). The env pickles without its function, which the receiving
process imports again by name.

Demonstrations for the SFT warm start come from a column of the row (``demo_column``, e.g. a
reference solution: text, or a list of texts, the actions of a multi-turn demonstration such as a
tool call and the answer that uses its result); without one the env has none, and a run needs
``sft.enabled=false``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.reward_funcs import (
    CallStyle,
    RewardFunctionError,
    load_reward_fn,
    load_reward_fns,
    total_reward,
)

__all__ = ["PromptRewardEnv", "RewardFunctionError", "chat_messages", "load_reward_fn"]


def _row_text(row: dict[str, Any], limit: int = 160) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[:limit] + "...}"


def chat_messages(value: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """A conversation checked (see the module docstring): copies of its messages, None keys dropped."""
    if not value:
        raise ValueError(f"{where} is an empty list; a conversation needs at least one message")
    out = []
    for i, message in enumerate(value, 1):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: message {i} is a {type(message).__name__}, not a "
                             "{role, content} object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: message {i} has no role (keys: {sorted(message)}); each message "
                             "needs a role (system, user, assistant) and a content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {i} ({role}) has content of type {type(content).__name__}; "
                             "it must be text (multimodal content parts are not supported)")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class PromptRewardEnv(Env):
    name: ClassVar[str] = "prompt_reward"
    calls_user_code: ClassVar[bool] = True

    def __init__(self, reward_fn: str | list[str] | None = None, prompt_column: str = "prompt",
                 success_threshold: float = 0.5, stop: Sequence[str] = (), demo_column: str | None = None,
                 reward_weights: list[float] | None = None, reward_call: CallStyle = "auto",
                 **options: Any) -> None:
        """Options: ``reward_fn`` (required: ``module.path:function`` or a list of them),
        ``reward_weights`` (one number per function, TRL's ``reward_weights``; default all 1),
        ``reward_call`` (``auto``: per function by its signature; ``batched``; ``per_sample``),
        ``prompt_column`` ("prompt": text or a list of chat messages), ``success_threshold``
        (0.5: success is reward >= it), ``stop`` (strings that end the completion, kept in it;
        default none: eos or ``rollout.max_new_tokens``), ``demo_column`` (a column holding a
        demonstration completion, for SFT; default none)."""
        super().__init__(**options)
        if reward_fn is None:
            raise ValueError("reward_fn is required: env.options.reward_fn=module.path:function (or a list), "
                             "a function (prompt, completion, **row) -> float or TRL's "
                             "(prompts, completions, **kwargs) -> list[float]")
        if not isinstance(prompt_column, str) or not prompt_column:
            raise ValueError(f"prompt_column must be a non-empty string, got {prompt_column!r}")
        if not isinstance(success_threshold, (int, float)) or not math.isfinite(success_threshold):
            raise ValueError(f"success_threshold must be a finite number, got {success_threshold!r}")
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        if demo_column is not None and (not isinstance(demo_column, str) or not demo_column):
            raise ValueError(f"demo_column must be a column name or null, got {demo_column!r}")
        self._reward_options = (reward_fn, reward_weights, reward_call)  # to load them again, unpickled
        self.reward_fns = load_reward_fns(reward_fn, reward_weights, reward_call)
        self.prompt_column, self.success_threshold = prompt_column, float(success_threshold)
        self.stop_strings = tuple(stop)  # type: ignore[misc]  # per instance: an option here
        self.demo_column = demo_column
        self.max_turns = 1
        self._task: Task | None = None
        self._action_ids: list[int] | None = None
        self._completion: list[dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the functions are loaded again from their specs where the env is unpickled (a hosted
        # call's child): a function pickles by name, if at all
        return {k: v for k, v in self.__dict__.items() if k != "reward_fns"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reward_fns = load_reward_fns(*self._reward_options)

    def call_site(self, method: str, task: Task) -> str:
        if method != "step":
            return super().call_site(method, task)
        row = {k: v for k, v in task.data.items() if k != self.prompt_column}
        specs = ", ".join(repr(f.spec) for f in self.reward_fns)
        what = "reward function" if len(self.reward_fns) == 1 else "reward functions"
        return f"{what} {specs} on {task.label} (row {_row_text(row)})"

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        raise ValueError("prompt_reward has no task generator: give your data with env.tasks_file "
                         "(JSONL, parquet or a datasets directory) or env.dataset.path")

    def _prompt_and_row(self, task: Task) -> tuple[Prompt, dict[str, Any]]:
        if self.prompt_column not in task.data:
            raise ValueError(f"{task.label} has no prompt column {self.prompt_column!r} (columns: "
                             f"{sorted(task.data)}); set env.options.prompt_column")
        prompt = task.data[self.prompt_column]
        where = f"{task.label}: prompt column {self.prompt_column!r}"
        if isinstance(prompt, list):
            prompt = chat_messages(prompt, where)
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where} must hold non-empty text or a list of chat messages "
                             f"({{role, content}}), got {type(prompt).__name__} {prompt!r:.80}")
        row = {k: v for k, v in task.data.items() if k != self.prompt_column}
        clash = [k for f in self.reward_fns for k in f.arguments if k in row]
        if clash:
            raise ValueError(f"{task.label}: column {clash[0]!r} clashes with the reward function's "
                             f"argument of that name; rename the column")
        for f in self.reward_fns:  # by signature: found when the run starts, not when the row is sampled
            missing = f.missing_columns(row)
            if missing:
                raise ValueError(
                    f"{task.label}: the reward function {f.spec!r} takes column"
                    f"{'s' if len(missing) > 1 else ''} {', '.join(repr(c) for c in missing)} (a parameter "
                    f"without a default), which this row lacks (its columns: {sorted(row)}); add "
                    f"{'it' if len(missing) == 1 else 'them'} to every row, or give the parameter a default")
        return prompt, row

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        prompt, _ = self._prompt_and_row(task)
        self._task, self._action_ids, self._completion = task, None, None
        return prompt

    def note_action_ids(self, ids: list[int]) -> None:
        self._action_ids = list(ids)

    def note_completion(self, messages: list[dict[str, Any]]) -> None:
        """With tools, the completion as chat messages: what the reward functions get (module docstring)."""
        self._completion = [dict(m) for m in messages]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("PromptRewardEnv.step called before reset (or after the episode ended)")
        task, self._task = self._task, None
        prompt, row = self._prompt_and_row(task)
        text = self._cut(action)
        completion: str | list[dict[str, Any]] = (
            text if isinstance(prompt, str) else [{"role": "assistant", "content": text}])
        if self._completion:  # an episode with tools: the whole conversation after the prompt
            completion = [*self._completion[:-1], {"role": "assistant", "content": text}]
        where = f"{task.label} (row {_row_text(row)})"
        values = [f.score(prompt, completion, self._action_ids, row, where) for f in self.reward_fns]
        reward = total_reward(self.reward_fns, values, where)
        metrics = {f"reward/{f.name}": v for f, v in zip(self.reward_fns, values) if v is not None}
        return StepResult("", reward, True, {"success": reward >= self.success_threshold, "metrics": metrics})

    def _cut(self, action: str) -> str:
        """The completion up to and including the first stop string (engines may run past it)."""
        ends = [action.find(s) + len(s) for s in self.stop_strings if s in action]
        return action[:min(ends)] if ends else action

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The row's ``demo_column`` as the completion: text, or a list of texts, the actions of a
        multi-turn demonstration (with tools: a call, then the reply that uses its result)."""
        if self.demo_column is None:
            raise NotImplementedError("prompt_reward has demonstrations only with env.options.demo_column "
                                      "(a column holding a reference completion); otherwise set "
                                      "sft.enabled=false")
        demo = task.data.get(self.demo_column)
        if isinstance(demo, list) and demo and all(isinstance(a, str) and a for a in demo):
            return list(demo)
        if not isinstance(demo, str) or not demo:
            raise ValueError(f"task {task.id!r}: demo column {self.demo_column!r} must hold non-empty text "
                             f"(or a list of non-empty texts, one per turn), got {demo!r:.80}")
        return [demo]
