"""Train/test splits of generated tasks, decided by their content.

A generator draws candidate problems from a seeded RNG; each candidate's content hashes to a
digest, and the digest alone says whether the candidate belongs to the test split (a fixed share
of all contents) or to train. So the splits are disjoint by construction, whatever the seeds and
sizes asked for, and the same content lands in the same split on every machine.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from saorl.data.task import Task
from saorl.errors import StartupError

Draw = Callable[[random.Random], "tuple[str, Callable[[str], Task]]"]
"""Draws one candidate: its content digest and a function making its :class:`Task` from it."""


def content_hash(*parts: object) -> str:
    """A stable hex digest of the problem content (same on every machine and Python run)."""
    text = "\x1f".join(str(p) for p in parts)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_of(digest: str, test_fraction: float) -> str:
    """'test' or 'train' from a content digest: disjointness is a property of the content."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    bucket = int(digest[:8], 16) / 0x1_0000_0000
    return "test" if bucket < test_fraction else "train"


def distinct_tasks(split: str, n: int, rng: random.Random, draw: Draw, test_fraction: float,
                   what: str) -> list[Task]:
    """``n`` distinct tasks (by id) whose content hashes into ``split``, in the order drawn.

    Candidates of the other split and repeats are drawn again, up to ``50 n + 1000`` draws; then a
    ``StartupError`` (a ``ValueError``) says how many distinct ``what`` were found (a content space too
    small for ``n``) and which setting to lower.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    tasks: dict[str, Task] = {}
    for _ in range(50 * n + 1000):
        if len(tasks) >= n:
            break
        digest, make = draw(rng)
        if split_of(digest, test_fraction) != split:
            continue
        task = make(digest)
        tasks.setdefault(task.id, task)
    if len(tasks) < n:
        raise StartupError(
            f"could only find {len(tasks)} distinct {split} {what}; asked for {n}: set "
            f"env.num_{split}_tasks to at most {len(tasks)}, or widen the env's options so that more "
            "distinct problems exist")
    return list(tasks.values())
