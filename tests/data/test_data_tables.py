"""Tasks from parquet files and datasets directories: ids, splits, disjointness, missing packages."""

from __future__ import annotations

import json
import sys

import pytest

from saorl.data.tables import row_hash, tasks_from_rows
from saorl.data.tasks import TaskFileError, file_splits, load_split, read_tasks
from saorl.envs.base import Task

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": f"What is {i}+{i}?", "answer": 2 * i} for i in range(6)]


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _ids(tasks):
    return [t.id for t in tasks]


def test_parquet_rows_become_tasks_with_content_ids(tmp_path):
    tasks = read_tasks(_parquet(tmp_path / "train.parquet", ROWS))
    assert [t.data for t in tasks] == ROWS
    assert _ids(tasks) == ["row-" + row_hash(r) for r in ROWS] and len(set(_ids(tasks))) == 6
    # the id is a property of the content: the same row elsewhere gets the same id
    assert _ids(read_tasks(_parquet(tmp_path / "again.parquet", ROWS[::-1]))) == _ids(tasks)[::-1]
    assert row_hash({"a": 1, "b": 2}) == row_hash({"b": 2, "a": 1}) != row_hash({"a": 1, "b": 3})


def test_id_columns():
    rows = [{"id": 7, "q": "a"}, {"id": "x", "q": "b"}]
    assert tasks_from_rows(rows, "f") == [Task("7", {"q": "a"}), Task("x", {"q": "b"})]
    rows = [{"uid": "u1", "id": 1, "q": "a"}]
    assert tasks_from_rows(rows, "f", id_column="uid") == [Task("u1", {"id": 1, "q": "a"})]
    with pytest.raises(TaskFileError, match=r"f row 2: duplicate id '1' \(first at row 1\)"):
        tasks_from_rows([{"id": 1}, {"id": "1"}], "f")
    with pytest.raises(TaskFileError, match=r"f row 1: no id column 'uid' \(columns: \['q'\]\)"):
        tasks_from_rows([{"q": 1}], "f", id_column="uid")
    for bad in (None, "", 1.5, True):
        with pytest.raises(TaskFileError, match="f row 1: id column 'id' must hold non-empty text or an int"):
            tasks_from_rows([{"id": bad}], "f")
    with pytest.raises(TaskFileError, match="f: no rows"):
        tasks_from_rows([], "f")


def test_repeated_rows_get_numbered_ids():
    tasks = tasks_from_rows([{"q": 1}, {"q": 2}, {"q": 1}, {"q": 1}], "f")
    h = "row-" + row_hash({"q": 1})
    assert _ids(tasks) == [h, "row-" + row_hash({"q": 2}), f"{h}#2", f"{h}#3"]


def test_datasets_directories_single_and_with_splits(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert [t.data for t in read_tasks(tmp_path / "single")] == ROWS
    test_rows = [{"prompt": "What is 9+9?", "answer": 18}]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(test_rows)})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [t.data for t in read_tasks(tmp_path / "dd", "test")] == test_rows
    assert _ids(read_tasks(tmp_path / "dd", "train")) == _ids(read_tasks(tmp_path / "single"))
    with pytest.raises(TaskFileError, match=r"dd has splits \['test', 'train'\]: name one"):
        read_tasks(tmp_path / "dd")
    with pytest.raises(TaskFileError, match=r"has no split 'valid'; its splits are \['test', 'train'\]"):
        read_tasks(tmp_path / "dd", "valid")
    with pytest.raises(TaskFileError, match="a single dataset without splits, but split 'train'"):
        read_tasks(tmp_path / "single", "train")


def test_directories_of_files_named_by_split(tmp_path):
    _parquet(tmp_path / "train.parquet", ROWS)
    (tmp_path / "test.jsonl").write_text(json.dumps({"id": "t1", "prompt": "p", "answer": 1}) + "\n")
    assert [t.data for t in read_tasks(tmp_path, "train")] == ROWS
    assert read_tasks(tmp_path, "test") == [Task("t1", {"prompt": "p", "answer": 1})]
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)  # the layout of a Hub dataset repository, sharded
    _parquet(hub / "data" / "train-00000-of-00002.parquet", ROWS[:3])
    _parquet(hub / "data" / "train-00001-of-00002.parquet", ROWS[3:])
    assert [t.data for t in read_tasks(hub, "train")] == ROWS
    with pytest.raises(TaskFileError, match=r"no file for split 'valid' \(looked for valid.parquet"):
        read_tasks(hub, "valid")
    with pytest.raises(TaskFileError, match="a directory, but not one written by datasets' save_to_disk"):
        read_tasks(hub)
    with pytest.raises(TaskFileError, match="split 'train' asked of a file"):
        read_tasks(tmp_path / "train.parquet", "train")


def test_bad_and_missing_files_never_go_to_the_hub(tmp_path, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("a local path went to the Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(TaskFileError, match=r"openai/gsm8k\.parquet: task file not found"):
        read_tasks("openai/gsm8k.parquet")
    with pytest.raises(TaskFileError, match="openai/gsm8k: task file not found"):
        read_tasks("openai/gsm8k")
    with pytest.raises(TaskFileError, match="openai/gsm8k: dataset not found"):  # env.dataset.path
        read_tasks("openai/gsm8k", split="train")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(TaskFileError, match=r"bad\.parquet: cannot read as parquet"):
        read_tasks(tmp_path / "bad.parquet")


def test_train_and_test_sources_must_be_disjoint(tmp_path):
    train = _parquet(tmp_path / "train.parquet", ROWS)
    test = _parquet(tmp_path / "test.parquet", [ROWS[4], {"prompt": "new", "answer": 0}])
    with pytest.raises(TaskFileError, match=r"1 task id\(s\) are in both the train split .*train\.parquet"):
        file_splits(train, test, 0)
    _parquet(test, [{"prompt": "new", "answer": 0}])
    tr, te = file_splits(train, test, 0)
    assert len(tr) == 6 and [t.data for t in te] == [{"prompt": "new", "answer": 0}]


def _cfg(*overrides):
    from saorl.config import load_config

    reward = "env.options.reward_fn=saorl.envs.rewards:number_answer"
    return load_config(None, ["env.type=prompt_reward", reward, *overrides])


def test_a_run_reads_its_splits_from_env_dataset(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:5]),
                               "validation": datasets.Dataset.from_list(ROWS[5:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = _cfg(f"env.dataset.path={tmp_path / 'dd'}", "env.dataset.test_split=validation")
    assert [t.data for t in load_split(None, cfg.env, "train", None, 0)] == ROWS[:5]
    assert [t.data for t in load_split(None, cfg.env, "test", None, 0)] == ROWS[5:]
    assert len(load_split(None, cfg.env, "train", 2, 0)) == 2
    # no test split: the tail of the train split is held out
    cfg = _cfg(f"env.dataset.path={tmp_path / 'dd'}", "env.dataset.test_split=null", "env.num_test_tasks=2")
    assert [t.data for t in load_split(None, cfg.env, "train", None, 0)] == ROWS[:3]
    assert [t.data for t in load_split(None, cfg.env, "test", None, 0)] == ROWS[3:5]
    # a test split that repeats a training row is refused
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "leaky"))
    cfg = _cfg(f"env.dataset.path={tmp_path / 'leaky'}")
    with pytest.raises(TaskFileError, match=r"in both the train split \(.*leaky \[train\]\) and the test"):
        load_split(None, cfg.env, "test", None, 0)


def test_tasks_file_takes_parquet_and_an_id_column(tmp_path):
    rows = [{"qid": f"q{i}", **r} for i, r in enumerate(ROWS)]
    train = _parquet(tmp_path / "train.parquet", rows)
    cfg = _cfg(f"env.tasks_file={train}", "env.id_column=qid", "env.num_test_tasks=2")
    assert _ids(load_split(None, cfg.env, "train", None, 0)) == ["q0", "q1", "q2", "q3"]
    assert _ids(load_split(None, cfg.env, "test", None, 0)) == ["q4", "q5"]


def test_missing_packages_say_what_to_install(tmp_path, monkeypatch):
    train = _parquet(tmp_path / "train.parquet", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(json.dumps({"id": "a", "q": 1}) + "\n")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import -> ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(TaskFileError, match=r"needs the optional package 'pyarrow\.parquet'.*saorl\[data\]"):
        read_tasks(train)
    with pytest.raises(TaskFileError, match=r"needs the optional package 'datasets'.*saorl\[data\]"):
        read_tasks(tmp_path / "single")
    assert read_tasks(jsonl) == [Task("a", {"q": 1})]  # JSONL needs neither
