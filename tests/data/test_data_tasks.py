"""Task files: both JSONL shapes, errors naming path:line, and the optional HF datasets loader."""

from __future__ import annotations

import json
import sys
import types

import pytest

from saorl.data.tasks import TaskFileError, load_tasks_hf, load_tasks_jsonl
from saorl.envs.base import Task


def _file(tmp_path, lines: list[str]):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_flat_and_wrapped_lines_and_blank_lines(tmp_path):
    path = _file(tmp_path, [
        json.dumps({"id": "t1", "question": "2+3", "answer": 5}),
        "",
        "   ",
        json.dumps({"id": "t2", "data": {"question": "4*4", "answer": 16}}),
        json.dumps({"id": "t3"}),
    ])
    assert load_tasks_jsonl(path) == [
        Task("t1", {"question": "2+3", "answer": 5}),
        Task("t2", {"question": "4*4", "answer": 16}),
        Task("t3", {}),
    ]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [('{"id": "x", "q": ', "malformed JSON"),
     ('[1, 2]', "expected a JSON object, got array"),
     ('"just a string"', "expected a JSON object, got string"),
     ('{"question": "1+1"}', "missing 'id'"),
     ('{"id": 7}', "'id' must be a non-empty string, got 7"),
     ('{"id": ""}', "'id' must be a non-empty string"),
     ('{"id": "x", "data": [1]}', "'data' must be a JSON object, got array"),
     ('{"id": "x", "data": {}, "answer": 1}', "may have no keys besides 'id', got ['answer']"),
     ('{"id": "t1", "q": 2}', "duplicate id 't1' (first at ")],
)
def test_errors_name_path_and_line(tmp_path, bad, reason):
    path = _file(tmp_path, ['{"id": "t1", "q": 1}', "", bad])
    with pytest.raises(TaskFileError) as info:
        load_tasks_jsonl(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: ") and reason in msg
    if "duplicate" in reason:
        assert msg.endswith(f"(first at {path}:1)")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TaskFileError, match="task file not found"):
        load_tasks_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks_jsonl(_file(tmp_path, ["", ""]))


def test_hf_loader_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        load_tasks_hf("some/dataset", "train")


def _fake_datasets(monkeypatch, rows):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hf_loader_maps_rows_like_jsonl(monkeypatch):
    calls = _fake_datasets(monkeypatch, [{"id": "a", "q": 1}, {"id": "b", "data": {"q": 2}}])
    assert load_tasks_hf("org/math", "test") == [Task("a", {"q": 1}), Task("b", {"q": 2})]
    assert calls == [("org/math", "test")]


def test_hf_loader_id_column_and_generated_ids(monkeypatch):
    _fake_datasets(monkeypatch, [{"uid": 11, "q": 1}, {"uid": 12, "q": 2}])
    assert load_tasks_hf("d", "train", id_field="uid") == [Task("11", {"q": 1}), Task("12", {"q": 2})]
    _fake_datasets(monkeypatch, [{"q": 1}, {"q": 2}])
    assert [t.id for t in load_tasks_hf("d", "train", id_field=None)] == ["train-0", "train-1"]


def test_hf_loader_errors_name_the_row(monkeypatch):
    _fake_datasets(monkeypatch, [{"id": "a"}, {"id": "a"}])
    with pytest.raises(TaskFileError, match=r"d \[train\] row 1: duplicate id 'a'"):
        load_tasks_hf("d", "train")
    _fake_datasets(monkeypatch, [{"q": 1}])
    with pytest.raises(TaskFileError, match=r"d \[train\] row 0: missing 'id'"):
        load_tasks_hf("d", "train")
