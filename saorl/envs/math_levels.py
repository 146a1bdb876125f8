"""``math_levels``: ``math_tool`` problems of mixed difficulty, with the level named in the prompt.

On plain ``math_tool`` every prompt is alike, so the return of a rollout is not predictable from
its prompt and a critic can learn little beyond the mean (value pretraining's held-out explained
variance stays near 0). Here each task is drawn uniformly from a list of *levels*, each a
``math_tool`` family and difficulty, and the prompt opens with the level::

    prompt   Level 1. Compute 27*555.\\n                       arith, difficulty 1: easy with the tool
    prompt   Level 4. Make 212 from 2 5 7 9 75 with + - *, each at most once.\\n     hard

so the chance of success is a property of the prompt the critic can read. The default levels go
from copying a tool's output (``arith:1``, which an SFT model solves nearly always) to a five-number
countdown (``countdown:3``, which it rarely does). Everything else — actions, the sandboxed tool,
rewards, demonstrations — is ``math_tool``'s (:class:`saorl.envs.math_tool.MathToolEnv`); the
demonstrations' failure rate is lower by default (0.2), so that most of a level's failures come
from its difficulty rather than from imitating a deliberately wrong demonstration.

Train and test tasks are separated by the same content hash as ``math_tool``'s.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from saorl.envs.base import Split, Task
from saorl.envs.math_tool import (
    TEST_FRACTION,
    MathToolEnv,
    _arith_problem,
    _content_key,
    _countdown_problem,
)
from saorl.envs.splits import content_hash, distinct_tasks

DEFAULT_LEVELS = ("arith:1", "arith:3", "countdown:1", "countdown:3")
_MAKERS = {"arith": _arith_problem, "countdown": _countdown_problem}


def parse_levels(levels: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``["arith:1", "countdown:3"]`` → ``(("arith", 1), ("countdown", 3))``; ValueError names a bad one."""
    if isinstance(levels, str) or not levels:
        raise ValueError(f"levels must be a non-empty list like ['arith:1', 'countdown:3'], got {levels!r}")
    parsed = []
    for item in levels:
        family, _, diff = str(item).partition(":")
        if family not in _MAKERS or diff not in ("1", "2", "3"):
            raise ValueError(f"levels: {item!r} is not 'FAMILY:DIFFICULTY' with FAMILY arith or countdown "
                             "and DIFFICULTY 1, 2 or 3")
        parsed.append((family, int(diff)))
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"levels must be distinct, got {list(levels)}")
    return tuple(parsed)


class MathLevelsEnv(MathToolEnv):
    name: ClassVar[str] = "math_levels"

    def __init__(self, levels: Sequence[str] = DEFAULT_LEVELS, demo_error_rate: float = 0.2,
                 **options: Any) -> None:
        """Options: ``levels`` (list of ``FAMILY:DIFFICULTY``, level k = the k-th entry, drawn
        uniformly), ``demo_error_rate`` (0.2), and ``math_tool``'s ``max_turns``,
        ``tool_timeout_s`` and ``hint``."""
        for fixed in ("family", "difficulty"):
            if fixed in options:
                raise ValueError(f"math_levels has no {fixed!r} option: each level names its own "
                                 "(option levels, e.g. ['arith:1', 'countdown:3'])")
        super().__init__(family="mix", demo_error_rate=demo_error_rate, **options)
        self.levels = parse_levels(levels)

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """``n`` distinct problems whose content hashes into ``split``, each from a uniform level."""

        def draw(rng: random.Random) -> tuple[str, Callable[[str], Task]]:
            level = rng.randrange(len(self.levels))
            family, difficulty = self.levels[level]
            data = _MAKERS[family](rng, difficulty) | {"difficulty": difficulty, "level": level + 1}
            return content_hash(*_content_key(data)), lambda digest: Task(
                f"math_levels/L{level + 1}/{digest[:16]}", data)

        spec = ",".join(f"{f}:{d}" for f, d in self.levels)
        rng = random.Random(f"math_levels/{split}/{spec}/{seed}")
        return distinct_tasks(split, n, rng, draw, TEST_FRACTION, f"problems for levels {spec}")

    def prompt(self, task: Task) -> str:
        level = task.data.get("level")
        if not isinstance(level, int) or level < 1:
            raise ValueError(f"task {task.id!r} is not a math_levels task (needs an int 'level' >= 1)")
        return f"Level {level}. " + super().prompt(task)
