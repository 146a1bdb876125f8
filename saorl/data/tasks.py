"""Task datasets from files: JSONL here; parquet and Hugging Face ``datasets`` directories in
:mod:`saorl.data.tables` (optional packages), all read through :func:`read_tasks`.

JSONL format: one JSON object per line; blank lines are skipped. Each object is a task in one of
two shapes:

- flat: ``{"id": "t1", "question": "2+3", "answer": 5}`` → ``Task("t1", {"question": ..., "answer": ...})``
  (every key except the id is the payload);
- wrapped: ``{"id": "t1", "data": {"question": "2+3", "answer": 5}}`` → the same task. A line is
  wrapped only when its keys are exactly ``id`` and ``data`` and ``data`` is an object; in any other
  line ``data`` is a column like the others (as in parquet, where no name is reserved).

Ids follow the rules of every row-shaped source (:mod:`saorl.data.tables`): ``env.id_column``,
else an ``id`` key (a non-empty string or an integer, unique in the file), else ``row-`` + a
hash of the line's content, so the Hub's ``train.jsonl`` files, which have no ids, load as they
are, and a row in both a train and a test file (JSONL or parquet) is caught by its hash.

A task source (:func:`read_tasks`) is a JSONL file (any name but the ones below), a ``.parquet``
file, or a directory: one written by ``datasets``' ``save_to_disk``, or one holding a file per
split (``train.parquet``, ``test.jsonl``, ...). No source needs an ``id`` column
(:mod:`saorl.data.tables` says how ids are made then).

Splits (:func:`load_tasks`, :func:`load_split`). Without files, an env's generator makes each
split (the env promises that train and test ids never overlap). With a train source and a test
source (``env.tasks_file`` + ``env.test_tasks_file``, or ``env.dataset`` with both split names),
each is its split, and an id in both is an error. With a train source alone, a run holds out its
last ``held_out`` tasks as the test split, so nothing it trains on (SFT demonstrations, value
pretraining rollouts, RL prompts) is ever evaluated on. The payload is handed to the env
unchanged, so which keys it needs is the env's business. Every problem raises
:class:`TaskFileError` naming ``path:line`` (or the row) and the reason.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from saorl.data import tables
from saorl.data.task import Task, TaskFileError


def record_row(record: Any, where: str) -> dict[str, Any]:
    """One JSON object (flat or wrapped, see the module docstring) → its row, the id still in it."""
    if not isinstance(record, Mapping):
        raise TaskFileError(f"{where}: expected a JSON object, got {_json_type(record)}")
    if set(record) == {"id", "data"} and isinstance(record["data"], Mapping):
        if "id" in record["data"]:
            raise TaskFileError(f"{where}: a wrapped task's 'data' has an 'id' of its own; give the line "
                                "flat (no 'data' key) with one id")
        return {"id": record["id"], **record["data"]}
    return dict(record)


MAX_LINE_CHARS = 64 * 2**20
"""The longest task line read (64 Mi characters; a 20 MB prompt is still read, and left out as
overlong at start-up): a longer one is an error, not a read that grows until memory runs out (a
file with no newline)."""


def _lines(f: Any, path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of each line of ``f``, each read with a bounded length."""
    lineno = 0
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
            raise TaskFileError(f"{path}:{lineno}: a line longer than {MAX_LINE_CHARS // 2**20} Mi "
                                "characters; a task file holds one JSON object per line")
        yield lineno, line


def check_regular_file(path: str | os.PathLike) -> None:
    """A :class:`TaskFileError` unless ``path`` is a regular file: a FIFO with no writer would block
    the read forever, and a device (``/dev/zero``) never ends."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
                or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise TaskFileError(f"{path}: {kind}; a task source is a regular file (JSONL or parquet) or a "
                            "dataset directory")


def load_tasks_jsonl(path: str | os.PathLike, id_column: str | None = None) -> list[Task]:
    """Read tasks from a JSONL file (format in the module docstring), in file order."""
    names, rows, lineno = [], [], 0
    try:
        check_regular_file(path)
        with open(path, encoding="utf-8") as f:
            for lineno, line in _lines(f, path):  # line by line: never the whole file at once
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TaskFileError(f"{where}: malformed JSON: {e.msg} at column {e.colno}") from None
                names.append(where)
                rows.append(record_row(record, where))
    except FileNotFoundError:
        raise TaskFileError(f"{path}: task file not found") from None
    except UnicodeDecodeError as e:
        raise TaskFileError(f"{path}: not UTF-8 text ({e.reason}, at line {lineno + 1} or just "
                            "after)") from None
    if not rows:
        raise TaskFileError(f"{path}: no tasks in the file")
    return tables.tasks_from_rows(rows, str(path), id_column, names=names)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


Split = Literal["train", "test"]


class TaskGenerator(Protocol):
    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]: ...


Source = tuple[str, str | None]
"""A task source: (path, split name or None); the split picks a part of a directory."""


def read_tasks(path: str | os.PathLike, split: str | None = None, id_column: str | None = None) -> list[Task]:
    """The tasks of one source (see the module docstring); ``split`` names a part of a directory."""
    p = Path(path)
    if not p.exists():
        what = "dataset" if split is not None else "task file"
        raise TaskFileError(f"{path}: {what} not found (saorl reads local files only; a relative path is "
                            f"relative to the directory saorl runs in, {Path.cwd()})")
    if p.is_dir():
        if tables.is_saved_dataset(p):
            return tables.load_tasks_hf(p, split, id_column)
        if split is None:
            raise TaskFileError(f"{path}: a directory, but not one written by datasets' save_to_disk; give a "
                                "file, or the directory as env.dataset.path with split names")
        files = tables.split_files(p, split)
        if not files:
            raise TaskFileError(f"{path}: no file for split {split!r} (looked for {split}.parquet, "
                                f"{split}.jsonl and {split}-*.parquet, also under data/)")
        if files[0].suffix == ".jsonl":
            return load_tasks_jsonl(files[0], id_column)
        return tables.load_tasks_parquet(files, id_column, where=f"{path} [{split}]")
    if split is not None:
        raise TaskFileError(f"{path}: split {split!r} asked of a file; splits are parts of a directory")
    check_regular_file(p)
    if p.suffix == ".parquet":
        return tables.load_tasks_parquet(p, id_column)
    return load_tasks_jsonl(p, id_column)


def load_tasks(env: TaskGenerator, split: Split, n: int | None, seed: int,
               tasks_file: str | os.PathLike | Source | None = None,
               test_tasks_file: str | os.PathLike | Source | None = None,
               held_out: int = 0, id_column: str | None = None) -> list[Task]:
    """The first ``n`` tasks (all when ``n`` is None) of ``split`` (see "Splits" above).

    Without ``tasks_file``: ``env.generate_tasks(split, n, seed)``. With it, ``seed`` does not
    apply: the train split is ``tasks_file`` less its last ``held_out`` tasks and the test split
    is ``test_tasks_file``, or else those last ``held_out`` tasks, or else (``held_out`` 0, no
    test file) the file itself is taken to hold tasks of the requested split. A source is a path
    or a ``(path, split name)`` pair.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if tasks_file is None:
        if test_tasks_file is not None:
            raise TaskFileError(f"{test_tasks_file}: a test tasks file needs a train tasks file too")
        if n is None or n < 0:
            raise ValueError(f"n must be a non-negative number of tasks to generate, got {n!r}")
        return env.generate_tasks(split, n, seed)
    train, test = file_splits(tasks_file, test_tasks_file, held_out, id_column)
    tasks = test if split == "test" and test is not None else train
    return tasks if n is None else tasks[:n]


def _source(src: str | os.PathLike | Source) -> Source:
    return (str(src[0]), src[1]) if isinstance(src, tuple) else (str(src), None)


def source_name(src: Source) -> str:
    """How errors name a source: its path, with the split in brackets when it has one."""
    return src[0] if src[1] is None else f"{src[0]} [{src[1]}]"


def file_splits(tasks_file: str | os.PathLike | Source, test_tasks_file: str | os.PathLike | Source | None,
                held_out: int, id_column: str | None = None) -> tuple[list[Task], list[Task] | None]:
    """``(train, test)`` from sources; ``test`` is None when there is neither a test source nor a hold-out."""
    train_src = _source(tasks_file)
    tasks = read_tasks(*train_src, id_column=id_column)
    if test_tasks_file is not None:
        test_src = _source(test_tasks_file)
        test = read_tasks(*test_src, id_column=id_column)
        check_disjoint(tasks, test, source_name(train_src), source_name(test_src))
        return tasks, test
    if held_out <= 0:
        return tasks, None
    if len(tasks) <= held_out:
        raise TaskFileError(f"{source_name(train_src)}: {len(tasks)} tasks, but {held_out} are held out as "
                            "the test split and at least one must be left to train on; give a test file "
                            "(env.test_tasks_file or env.dataset.test_split) or lower env.num_test_tasks")
    return tasks[:-held_out], tasks[-held_out:]


def check_disjoint(train: Iterable[Task], test: Iterable[Task], train_name: str, test_name: str) -> None:
    """``TaskFileError`` naming an id that is in both splits."""
    ids = {t.id for t in train}
    shared = [t.id for t in test if t.id in ids]
    if shared:
        raise TaskFileError(f"{len(shared)} task id(s) are in both the train split ({train_name}) and the "
                            f"test split ({test_name}), e.g. {shared[0]!r}: a model would be evaluated "
                            "on tasks it trained on")


def env_sources(env_cfg: Any) -> tuple[Source | None, Source | None]:
    """(train, test) sources of a run's ``env`` config section: ``env.dataset`` (a path and split
    names) or ``env.tasks_file`` / ``env.test_tasks_file``; (None, None) for the env's generator."""
    ds = env_cfg.dataset
    if ds is not None:
        return (ds.path, ds.train_split), (None if ds.test_split is None else (ds.path, ds.test_split))
    train = None if env_cfg.tasks_file is None else (env_cfg.tasks_file, None)
    test = None if env_cfg.test_tasks_file is None else (env_cfg.test_tasks_file, None)
    return train, test


def held_out_seed(cfg: Any) -> int:
    """The seed a run's held-out tasks are drawn with: ``env.test_seed``, else the run's ``seed``."""
    return cfg.seed if cfg.env.test_seed is None else cfg.env.test_seed


def load_split(env: TaskGenerator, env_cfg: Any, split: Split, n: int | None, seed: int) -> list[Task]:
    """:func:`load_tasks` with the sources and hold-out of a run's ``env`` config section
    (``dataset`` or ``tasks_file`` / ``test_tasks_file``, ``num_test_tasks``, ``id_column``):
    every stage reads its tasks here."""
    train, test = env_sources(env_cfg)
    held = 0 if test is not None else env_cfg.num_test_tasks
    return load_tasks(env, split, n, seed, train, test, held_out=held, id_column=env_cfg.id_column)
