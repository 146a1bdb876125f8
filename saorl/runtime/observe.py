"""Hooks for watching a run from outside (benchmarks, tests), and the timings it reports.

An :class:`Observer` is handed to :func:`saorl.training.train`; the run calls it as rollouts
are dispatched and arrive and as steps finish. Every method is a no-op here: subclass and
override what you need. :class:`~saorl.runtime.learner.timings.Timings` accumulates seconds per labelled
span; the learner keeps one (``Learner.timings``) so a profile reads where a step's time went
without patching it.
"""

from __future__ import annotations

from typing import Any

from saorl.data.trajectory import Trajectory


class Observer:
    """What a run reports while it runs (all no-ops; override what you need)."""

    def rollout_dispatched(self, rid: int, t: float) -> None:
        """Rollout ``rid`` was handed to the backend at wall-clock time ``t``."""

    def rollouts_finished(self, trajectories: list[Trajectory]) -> None:
        """These finished rollouts arrived (and were journalled), before any training on them;
        each one's rollout id is ``episode.rid``."""

    def step_done(self, step: int, metrics: dict[str, Any], trajectories: list[Trajectory]) -> None:
        """Trainer step ``step`` trained on ``trajectories`` and logged ``metrics``."""

    def run_finished(self) -> None:
        """The run stopped (after its final checkpoint)."""


