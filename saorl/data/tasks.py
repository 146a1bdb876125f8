"""Task datasets from files: JSONL and (optionally) Hugging Face ``datasets``.

JSONL format: one JSON object per line; blank lines are skipped. Each object is a task in one of
two shapes:

- flat: ``{"id": "t1", "question": "2+3", "answer": 5}`` → ``Task("t1", {"question": ..., "answer": ...})``
  (every key except ``id`` is the payload);
- wrapped: ``{"id": "t1", "data": {"question": "2+3", "answer": 5}}`` → the same task
  (``data`` must be an object and the only other key).

``id`` must be a non-empty string, unique in the file.

Splits (:func:`load_tasks`). Without files, an env's generator makes each split (the env promises
that train and test ids never overlap). With a train file and a test file, each file is its
split, and an id in both is an error. With a train file alone, a run holds out its last
``held_out`` tasks as the test split, so nothing it trains on (SFT demonstrations, value
pretraining rollouts, RL prompts) is ever evaluated on. The payload is handed to the env
unchanged, so which keys it needs is the env's business. Every problem raises
:class:`TaskFileError` naming ``path:line`` and the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from saorl.data.task import Task


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


Split = Literal["train", "test"]


class TaskGenerator(Protocol):
    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]: ...


def load_tasks(env: TaskGenerator, split: Split, n: int | None, seed: int,
               tasks_file: str | os.PathLike | None = None, test_tasks_file: str | os.PathLike | None = None,
               held_out: int = 0) -> list[Task]:
    """The first ``n`` tasks (all when ``n`` is None) of ``split`` (see "Splits" above).

    Without ``tasks_file``: ``env.generate_tasks(split, n, seed)``. With it, ``seed`` does not
    apply: the train split is ``tasks_file`` less its last ``held_out`` tasks and the test split
    is ``test_tasks_file``, or else those last ``held_out`` tasks, or else (``held_out`` 0, no
    test file) the file itself is taken to hold tasks of the requested split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if tasks_file is None:
        if test_tasks_file is not None:
            raise TaskFileError(f"{test_tasks_file}: a test tasks file needs a train tasks file too")
        if n is None or n < 0:
            raise ValueError(f"n must be a non-negative number of tasks to generate, got {n!r}")
        return env.generate_tasks(split, n, seed)
    train, test = file_splits(tasks_file, test_tasks_file, held_out)
    tasks = test if split == "test" and test is not None else train
    return tasks if n is None else tasks[:n]


def file_splits(tasks_file: str | os.PathLike, test_tasks_file: str | os.PathLike | None,
                held_out: int) -> tuple[list[Task], list[Task] | None]:
    """``(train, test)`` from files; ``test`` is None when there is neither a test file nor a hold-out."""
    tasks = load_tasks_jsonl(tasks_file)
    if test_tasks_file is not None:
        test = load_tasks_jsonl(test_tasks_file)
        check_disjoint(tasks, test, str(tasks_file), str(test_tasks_file))
        return tasks, test
    if held_out <= 0:
        return tasks, None
    if len(tasks) <= held_out:
        raise TaskFileError(f"{tasks_file}: {len(tasks)} tasks, but {held_out} are held out as the test "
                            "split and at least one must be left to train on; give a test file "
                            "(env.test_tasks_file) or lower env.num_test_tasks")
    return tasks[:-held_out], tasks[-held_out:]


def check_disjoint(train: Iterable[Task], test: Iterable[Task], train_name: str, test_name: str) -> None:
    """``TaskFileError`` naming an id that is in both splits."""
    ids = {t.id for t in train}
    shared = [t.id for t in test if t.id in ids]
    if shared:
        raise TaskFileError(f"{len(shared)} task id(s) are in both the train split ({train_name}) and the "
                            f"test split ({test_name}), e.g. {shared[0]!r}: a model would be evaluated "
                            "on tasks it trained on")


def load_split(env: TaskGenerator, env_cfg: Any, split: Split, n: int | None, seed: int) -> list[Task]:
    """:func:`load_tasks` with the files and hold-out of a run's ``env`` config section
    (``tasks_file``, ``test_tasks_file``, ``num_test_tasks``): every stage reads its tasks here."""
    held = 0 if env_cfg.test_tasks_file else env_cfg.num_test_tasks
    return load_tasks(env, split, n, seed, env_cfg.tasks_file, env_cfg.test_tasks_file, held_out=held)
