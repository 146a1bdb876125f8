"""Task datasets from files: JSONL and (optionally) Hugging Face ``datasets``.

JSONL format: one JSON object per line; blank lines are skipped. Each object is a task in one of
two shapes:

- flat: ``{"id": "t1", "question": "2+3", "answer": 5}`` → ``Task("t1", {"question": ..., "answer": ...})``
  (every key except ``id`` is the payload);
- wrapped: ``{"id": "t1", "data": {"question": "2+3", "answer": 5}}`` → the same task
  (``data`` must be an object and the only other key).

``id`` must be a non-empty string, unique in the file. The payload is handed to the env
unchanged, so which keys it needs is the env's business. Every problem raises
:class:`TaskFileError` naming ``path:line`` and the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from saorl.envs.base import Task


class TaskFileError(ValueError):
    """A task file (or dataset) that cannot be read as tasks; the message names where and why."""


def task_from_record(record: Any, where: str) -> Task:
    """One JSON object (flat or wrapped, see the module docstring) → ``Task``; ``where`` prefixes errors."""
    if not isinstance(record, Mapping):
        raise TaskFileError(f"{where}: expected a JSON object, got {_json_type(record)}")
    if "id" not in record:
        raise TaskFileError(f"{where}: missing 'id'")
    task_id = record["id"]
    if not isinstance(task_id, str) or not task_id:
        raise TaskFileError(f"{where}: 'id' must be a non-empty string, got {task_id!r}")
    if "data" in record:
        extra = sorted(set(record) - {"id", "data"})
        if extra:
            raise TaskFileError(f"{where}: a task with 'data' may have no keys besides 'id', got {extra}")
        data = record["data"]
        if not isinstance(data, Mapping):
            raise TaskFileError(f"{where}: 'data' must be a JSON object, got {_json_type(data)}")
        return Task(id=task_id, data=dict(data))
    return Task(id=task_id, data={k: v for k, v in record.items() if k != "id"})


def load_tasks_jsonl(path: str | os.PathLike) -> list[Task]:
    """Read tasks from a JSONL file (format in the module docstring), in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise TaskFileError(f"{path}: task file not found") from None
    except UnicodeDecodeError as e:
        raise TaskFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}:{lineno}: malformed JSON: {e.msg} at column {e.colno}") from None
    tasks = _unique(records)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks in the file")
    return tasks


def _unique(records: Iterable[tuple[str, Any]]) -> list[Task]:
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for where, record in records:
        task = task_from_record(record, where)
        if task.id in seen:
            raise TaskFileError(f"{where}: duplicate id {task.id!r} (first at {seen[task.id]})")
        seen[task.id] = where
        tasks.append(task)
    return tasks


def load_tasks_hf(path_or_name: str | os.PathLike, split: str, id_field: str | None = "id") -> list[Task]:
    """Tasks from a Hugging Face dataset (a local directory, a data file or a hub name), one per row.

    Rows map like JSONL records. With ``id_field`` other than ``"id"``, that column becomes the
    id; with ``id_field=None``, ids are ``"<split>-<row index>"``. Needs the optional
    ``datasets`` package. Local directories saved with ``Dataset.save_to_disk`` are loaded with
    ``load_from_disk``; anything else goes through ``load_dataset``.
    """
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "load_tasks_hf needs the Hugging Face 'datasets' package, which is not installed: "
            "pip install datasets (or convert the data to JSONL and use load_tasks_jsonl)"
        ) from None
    name = str(path_or_name)
    try:
        if Path(name).is_dir() and (Path(name) / "dataset_info.json").exists():
            ds = datasets.load_from_disk(name)
            ds = ds[split] if isinstance(ds, Mapping) or hasattr(ds, "keys") else ds
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise TaskFileError(f"{name} [{split}]: cannot load dataset: {e}") from e
    return _unique(_rows(ds, name, split, id_field))


def _rows(ds: Iterable[Mapping[str, Any]], name: str, split: str, id_field: str | None):
    for i, row in enumerate(ds):
        where = f"{name} [{split}] row {i}"
        row = dict(row)
        if id_field is None:
            if "id" in row:
                raise TaskFileError(f"{where}: has an 'id' column; pass id_field='id' to use it")
            row = {"id": f"{split}-{i}", **row}
        elif id_field != "id":
            if id_field not in row:
                raise TaskFileError(f"{where}: missing id column {id_field!r}")
            if "id" in row:
                raise TaskFileError(f"{where}: has both 'id' and id column {id_field!r}")
            value = row.pop(id_field)
            row = {"id": value if isinstance(value, str) else str(value), **row}
        yield where, row


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
