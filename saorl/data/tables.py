"""Tasks from tabular data: parquet files and Hugging Face ``datasets`` directories, local only;
and the ids of every row-shaped source (JSONL lines too, :mod:`saorl.data.tasks`).

One row is one task; every column but the id is the payload (``Task.data``), handed to the env
unchanged (``prompt_reward`` reads its prompt column and passes the rest to the reward function).

Ids. With ``id_column`` set, that column (text or an integer) is the id and is removed from the
payload; else an ``id`` column is used the same way when there is one; else a row's id is
``row-`` + a hash of its content, so the same row in a train and a test file gets the same id
and :func:`saorl.data.tasks.check_disjoint` catches it. Rows repeated within one source get
``#2``, ``#3``, … appended. Any other duplicate id is an error naming the rows (numbered from 1).

Sources (nothing here ever downloads: a path that does not exist is an error, never a Hub name):

- a ``.parquet`` file (read with ``pyarrow``);
- a directory written by ``Dataset.save_to_disk`` (one split) or ``DatasetDict.save_to_disk``
  (pick the split by name), read with ``datasets.load_from_disk``;
- a directory of files named by split: ``<split>.parquet``, ``<split>.jsonl``, or parquet shards
  ``<split>-*.parquet`` (also under ``data/``, the layout of a Hub dataset repository).

``pyarrow`` and ``datasets`` are optional (``pip install "saorl[data]"``); reading a source that
needs one without it raises :class:`~saorl.data.tasks.TaskFileError` saying what to install.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from saorl.data.task import Task, TaskFileError

INSTALL = 'pip install "saorl[data]"'


class MissingDependency(TaskFileError):
    """A data source needs an optional package that is not installed."""


def _require(module: str, path: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{path}: reading it needs the optional package {module!r}, which is not "
                                f"installed: {INSTALL} (or convert the data to JSONL)") from None


def row_hash(row: Mapping[str, Any]) -> str:
    """A stable digest of a row's content (keys sorted; values as JSON, else as text)."""
    text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def tasks_from_rows(rows: Iterable[Mapping[str, Any]], where: str, id_column: str | None = None,
                    names: Iterable[str] | None = None) -> list[Task]:
    """Rows → tasks with ids as the module docstring says; errors name ``where`` and the row
    (``{where} row N``, numbered from 1), or the row's own name from ``names`` (JSONL: ``path:line``)."""
    tasks: list[Task] = []
    first: dict[str, str] = {}
    repeats: dict[str, int] = {}
    named = (((f"{where} row {i}", f"row {i}"), row) for i, row in enumerate(rows, 1)) if names is None \
        else (((name, name), row) for name, row in zip(names, rows, strict=True))
    for (name, ref), row in named:
        data = dict(row)
        column = id_column or ("id" if "id" in data else None)
        if column is not None:
            if column not in data:
                raise TaskFileError(f"{name}: no id column {column!r} (columns: {sorted(data)})")
            value = data.pop(column)
            if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
                raise TaskFileError(f"{name}: id column {column!r} must hold non-empty text or an "
                                    f"integer, got {value!r}")
            task_id = str(value)
            if task_id in first:
                raise TaskFileError(f"{name}: duplicate id {task_id!r} (first at {first[task_id]})")
        else:
            task_id = "row-" + row_hash(data)
            if task_id in first:
                repeats[task_id] = repeats.get(task_id, 1) + 1
                task_id = f"{task_id}#{repeats[task_id]}"
        first[task_id] = ref
        tasks.append(Task(task_id, data, source=name))
    if not tasks:
        raise TaskFileError(f"{where}: no rows")
    return tasks


def parquet_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of one parquet file (``pyarrow``), as dicts."""
    pq = _require("pyarrow.parquet", str(path))
    if not Path(path).is_file():
        raise TaskFileError(f"{path}: task file not found")
    try:  # batch by batch: never the whole table and its Python rows at once
        rows: list[dict[str, Any]] = []
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            rows += batch.to_pylist()
        return rows
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc. for a file that is not parquet
        raise TaskFileError(f"{path}: cannot read as parquet: {type(e).__name__}: {e}") from None


def load_tasks_parquet(paths: str | os.PathLike | list[Path], id_column: str | None = None,
                       where: str | None = None) -> list[Task]:
    """Tasks from one parquet file, or from the rows of several shards in order."""
    files = paths if isinstance(paths, list) else [Path(paths)]
    rows = [row for f in files for row in parquet_rows(f)]
    return tasks_from_rows(rows, where or str(files[0]), id_column)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "state.json",
                                                                 "dataset_info.json"))


def load_tasks_hf(path: str | os.PathLike, split: str | None = None,
                  id_column: str | None = None) -> list[Task]:
    """Tasks from a local ``save_to_disk`` directory; ``split`` picks one of a ``DatasetDict``'s
    splits (a single ``Dataset`` takes ``split`` None). Never a Hub name: download and save the
    dataset first (``datasets.load_dataset(NAME).save_to_disk(DIR)``)."""
    where = str(path)
    if not is_saved_dataset(Path(path)):
        raise TaskFileError(f"{where}: not a directory written by datasets' save_to_disk (no "
                            "dataset_dict.json or state.json); saorl reads local data only: for a Hub "
                            "dataset run datasets.load_dataset(NAME).save_to_disk(DIR) and give DIR")
    datasets = _require("datasets", where)
    try:
        ds = datasets.load_from_disk(where)
    except Exception as e:
        raise TaskFileError(f"{where}: cannot load the dataset: {type(e).__name__}: {e}") from None
    if hasattr(ds, "keys"):  # a DatasetDict
        names = sorted(ds.keys())
        if split is None or split not in names:
            what = "has splits" if split is None else f"has no split {split!r}; its splits are"
            raise TaskFileError(f"{where} {what} {names}: name one (env.dataset.train_split / test_split)")
        ds, where = ds[split], f"{where} [{split}]"
    elif split is not None:
        raise TaskFileError(f"{where}: a single dataset without splits, but split {split!r} was asked "
                            "for; give it as env.tasks_file instead")
    return tasks_from_rows(ds, where, id_column)


def split_files(directory: Path, split: str) -> list[Path]:
    """The files of ``split`` in a directory of files named by split (see the module docstring)."""
    for base in (directory, directory / "data"):
        for name in (f"{split}.parquet", f"{split}.jsonl"):
            if (base / name).is_file():
                return [base / name]
        shards = sorted(base.glob(f"{split}-*.parquet"))
        if shards:
            return shards
    return []
