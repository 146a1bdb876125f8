"""``mix``: several environments in one run, each task played and rewarded by the env it came from.

``env.mix: [{type, options, weight, name}, ...]`` (the config sets ``env.type: mix``). A mix task
is one of a part's own tasks, its id prefixed by the part's name (``math_tool/countdown-…``) and
its data wrapped (``{"env": name, "task": data}``); ``reset`` hands it, unwrapped, to a fresh env
of that part, and the episode is that env's, turn by turn: its prompt, stop strings, turn limit,
observations, rewards and end (the agent loop reads them off this env after ``reset``).

- **Train tasks** are drawn by weight: a seeded draw picks each task's part, and each part's share
  comes from its own generator (the same seed), in the order drawn.
- **Test tasks** are split by weight, largest remainder first, at least one per part when there are
  as many tasks as parts, and interleaved part by part, so the first ``run.eval_tasks`` of them
  hold every part.
- **Metrics.** The last step's ``info["metrics"]`` holds the part's own metrics and its
  ``reward`` (the episode's total) and ``success``, each under ``<name>/``: the trainer logs their
  means over that part's trajectories of a step (``env/<name>/reward``), evaluation
  ``eval/env/<name>/...``; :meth:`MixEnv.task_group` tells evaluation which part a task belongs
  to, for ``eval/<name>/accuracy`` (:mod:`saorl.stages.evaluate`).

A part's observation format and role are its class's (the run's ``env.observation_format`` /
``env.observation_role`` set them for every part). Parts run in the worker's own threads: an env
of user code (``module.path:ClassName``) runs without ``env.call_timeout_s``'s child process, so
it is refused here, as is ``prompt_reward`` (its tasks come from files) and a mix in a mix.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.registry import EnvFactory, make_env_factory, resolve_env, runs_user_code


def _allocate(n: int, weights: list[float]) -> list[int]:
    """``n`` split by ``weights``: largest remainder, at least one each when ``n`` allows."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    if n >= len(weights):
        for i, c in enumerate(counts):
            if c == 0:
                donor = max(range(len(counts)), key=counts.__getitem__)
                counts[donor] -= 1
                counts[i] = 1
    return counts


class MixEnv(Env):
    name: ClassVar[str] = "mix"

    def __init__(self, envs: list[Mapping[str, Any]] | None = None, **options: Any) -> None:
        """Options: ``envs``, the parts: ``{type, options, weight, name}`` each (``env.mix``)."""
        super().__init__(**options)
        if not envs:
            raise ValueError("a mix needs at least one env: env.mix=[{type: ..., options: ..., weight: ...}]")
        self.parts: dict[str, EnvFactory] = {}
        self.weights: dict[str, float] = {}
        for i, entry in enumerate(envs):
            kind = entry.get("type")
            name = entry.get("name") or kind
            where = f"env.mix[{i}] ({kind})"
            if kind in ("mix", "prompt_reward"):
                raise ValueError(f"{where}: a {kind} env cannot be part of a mix")
            if runs_user_code(resolve_env(kind)):
                raise ValueError(f"{where}: an env of user code cannot be part of a mix (it would run "
                                 "without env.call_timeout_s); train it alone")
            if name in self.parts:
                raise ValueError(f"{where}: the name {name!r} is taken by another part; give each part of "
                                 "one type its own name (env.mix[i].name)")
            try:
                self.parts[name] = make_env_factory(kind, entry.get("options") or {})
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            self.weights[name] = float(entry.get("weight", 1.0))
        self._env: Env | None = None
        self._part = ""
        self._total = 0.0

    @staticmethod
    def task_group(task: Task) -> str | None:
        """The name of the part a mix task belongs to (None for a task that is not a mix task)."""
        name = task.data.get("env") if isinstance(task.data, dict) else None
        return name if isinstance(name, str) and task.id.startswith(f"{name}/") else None

    def _wrap(self, name: str, task: Task) -> Task:
        return Task(f"{name}/{task.id}", {"env": name, "task": task.data}, task.prompt_limit)

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        names = list(self.parts)
        weights = [self.weights[k] for k in names]
        if split == "test":
            counts = dict(zip(names, _allocate(n, weights)))
            order = [k for i in range(n) for k in names if counts[k] > i]
        else:
            order = random.Random(seed).choices(names, weights=weights, k=n)
            counts = {k: order.count(k) for k in names}
        pools = {k: iter(self.parts[k]().generate_tasks(split, counts[k], seed)) if counts[k] else iter(())
                 for k in names}
        return [self._wrap(k, next(pools[k])) for k in order]

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        name = self.task_group(task)
        if name not in self.parts:
            raise ValueError(f"task {task.id!r} is not a task of this mix (its parts: {sorted(self.parts)})")
        env = self._env = self.parts[name]()
        self._part, self._total = name, 0.0
        inner = Task(task.id[len(name) + 1:], task.data["task"], task.prompt_limit)
        prompt = env.reset(inner, progress)
        # the agent loop reads these off the env it plays after reset: the part's, for this episode
        self.stop_strings = env.stop_strings  # type: ignore[misc]
        if self.toolbox is None:  # with env.tools the run's env.tool_max_turns, stamped on the mix
            self.max_turns = env.max_turns
        for key in ("observation_format", "observation_role"):
            if key not in self.__dict__:  # not set for the run (env.observation_format)
                setattr(self, key, getattr(env, key))
        return prompt

    def note_action_ids(self, ids: list[int]) -> None:
        if self._env is not None:
            self._env.note_action_ids(ids)

    def step(self, action: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("MixEnv.step called before reset (or after the episode ended)")
        out = self._env.step(action)
        self._total += out.reward
        if not out.done:
            return out
        self._env = None
        info = dict(out.info)
        metrics = {f"{self._part}/{k}": v for k, v in (info.get("metrics") or {}).items()}
        metrics[f"{self._part}/reward"] = self._total
        metrics[f"{self._part}/success"] = float(bool(info.get("success")))
        info["metrics"] = metrics
        return StepResult(out.observation, out.reward, True, info)

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        name = self.task_group(task)
        if name not in self.parts:
            raise ValueError(f"task {task.id!r} is not a task of this mix")
        return self.parts[name]().demonstration(Task(task.id[len(name) + 1:], task.data["task"]), rng)
