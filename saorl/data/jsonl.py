"""Reading the JSON-lines files a run writes (metrics, evaluations, audit trail, rollouts)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """``(line number, JSON value)`` of each line of a JSON-lines file; none when it does not exist.

    Blank lines are skipped, and so is an unparsable *last* line: a writer killed mid-line
    (``kill -9``) leaves one, and what came before it is intact. An unparsable line anywhere
    else is corruption, not a torn write: ``ValueError`` naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        return
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    for i, (lineno, line) in enumerate(lines):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                return
            raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg}); the file is damaged") from None
        yield lineno, value


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """Every JSON value of a JSON-lines file, in order (see :func:`iter_jsonl`)."""
    return [value for _, value in iter_jsonl(path)]
