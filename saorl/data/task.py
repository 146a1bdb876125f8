"""A task: one prompt's payload, as the task stream and the environments see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    id: str
    """Unique across splits; the data cursor and resume logic key on it."""
    data: dict[str, Any]
    """JSON-serialisable task payload, interpreted by the env."""
    prompt_limit: int | None = None
    """The most tokens its prompt may have: over it, the agent loop cuts the prompt to fit,
    keeping its end (``env.overlong_prompts: truncate``, :mod:`saorl.agent.prompt_cut`); None:
    the prompt is played as it is."""


class TaskFileError(ValueError):
    """A task file (or dataset) that cannot be read as tasks; the message names where and why.
    (Here, beside :class:`Task`, so that the optional readers of :mod:`saorl.data.tables` raise it
    without importing :mod:`saorl.data.tasks`, which imports them.)"""
