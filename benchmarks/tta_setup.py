"""What every arm of ``bench_tta.py`` is given (:class:`Setup`, written as ``setup.json``) and the
tasks it knows (``--task``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import tta_calc  # noqa: E402
import tta_task  # noqa: E402

TASKS = {"arith": tta_task, "calc": tta_calc}
"""``--task``: the module of each (its problems, tasks file, the arms' settings, evaluator)."""


@dataclass
class Setup:
    """What every arm is given (written as ``setup.json``; the TRL child reads it)."""

    model: str
    chat: bool
    task: str
    train_file: str
    test_file: str
    budget_s: float
    fractions: list[float]
    lr: float
    batch: int
    group: int
    max_new: int
    trl_threads: int
    format_reward: float | None = None
    """``--task arith``: the bare-integer term's weight (None: the task's 0.5)."""
    eval_temperature: float = 0.0
    """The evaluator's: 0 greedy; > 0 one episode a problem sampled at it (seed 0, every model alike)."""


def task_options(s: Setup) -> dict:
    """The task's own settings every arm is given (``--format-reward``), where set."""
    return {} if s.format_reward is None else {"format_reward": s.format_reward}
