"""A task: one prompt's payload, as the task stream and the environments see it."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    source: str | None = field(default=None, compare=False, repr=False)
    """Where it was read: ``path:line`` of a JSONL file, ``path row N`` of a table; None for a
    generated task. Messages about the task name it (:attr:`label`), not only its id, which for a
    file without an id column is a hash of the row. Not part of the task's identity (equality)."""

    @property
    def label(self) -> str:
        """``task 'ID'``, and where it was read from (``task 'row-3f2a…' (data/train.jsonl:12)``)."""
        return f"task {self.id!r}" + (f" ({self.source})" if self.source else "")


class TaskFileError(ValueError):
    """A task file (or dataset) that cannot be read as tasks; the message names where and why.
    (Here, beside :class:`Task`, so that the optional readers of :mod:`saorl.data.tables` raise it
    without importing :mod:`saorl.data.tasks`, which imports them.)"""
