"""Task files: both JSONL shapes, errors naming path:line, and the train/test splits of a run."""

from __future__ import annotations

import json

import pytest

from saorl.data.tasks import TaskFileError, load_tasks_jsonl
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
     ('{"id": 1.5}', "id column 'id' must hold non-empty text or an integer, got 1.5"),
     ('{"id": ""}', "id column 'id' must hold non-empty text or an integer"),
     ('{"id": null, "q": 1}', "id column 'id' must hold non-empty text or an integer, got None"),
     ('{"id": "x", "data": {"id": "y"}}', "a wrapped task's 'data' has an 'id' of its own"),
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


def test_lines_without_ids_get_the_ids_parquet_rows_get(tmp_path):
    """A Hub ``train.jsonl`` has no ``id``: each line's id is ``row-`` + the hash of its content,
    as for a parquet row, so the same row in a JSONL train file and a parquet test file is caught."""
    from saorl.data.tables import row_hash
    from saorl.data.tasks import check_disjoint, read_tasks

    rows = [{"question": "Natalia sold 48 clips.", "answer": "#### 72"}, {"question": "2+2", "answer": "4"},
            {"question": "2+2", "answer": "4"}]
    path = _file(tmp_path, [json.dumps(r) for r in rows])
    tasks = read_tasks(path)
    h0, h1 = ("row-" + row_hash(r) for r in rows[:2])
    assert [t.id for t in tasks] == [h0, h1, f"{h1}#2"] and [t.data for t in tasks] == rows
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:2]), tmp_path / "test.parquet")
    test = read_tasks(tmp_path / "test.parquet")
    assert [t.id for t in test] == [h1]
    with pytest.raises(TaskFileError, match=rf"in both the train split .* e\.g\. '{h1}'"):
        check_disjoint(tasks, test, str(path), "test.parquet")


def test_ids_as_for_parquet_rows_integers_and_id_column(tmp_path):
    path = _file(tmp_path, ['{"id": 7, "q": "a"}', '{"id": "x", "q": "b"}'])
    assert load_tasks_jsonl(path) == [Task("7", {"q": "a"}), Task("x", {"q": "b"})]
    path = _file(tmp_path, ['{"uid": "u1", "id": 1, "q": "a"}'])
    assert load_tasks_jsonl(path, id_column="uid") == [Task("u1", {"id": 1, "q": "a"})]
    from saorl.data.tasks import read_tasks

    assert read_tasks(path, id_column="uid") == [Task("u1", {"id": 1, "q": "a"})]
    with pytest.raises(TaskFileError, match=rf"^{path}:1: no id column 'nope'"):
        load_tasks_jsonl(path, id_column="nope")


def test_a_column_named_data_is_a_column_unless_the_line_is_wrapped(tmp_path):
    """``data`` is saorl's wrapped shape only for a line of exactly ``id`` and an object ``data``;
    in any other line it is the user's column, as it is in parquet."""
    path = _file(tmp_path, [
        json.dumps({"id": "a", "prompt": "p", "data": "some text"}),
        json.dumps({"id": "b", "data": [1, 2]}),
        json.dumps({"prompt": "q", "data": {"source": "gsm8k"}}),
        json.dumps({"id": "c", "data": {"prompt": "r"}}),
    ])
    tasks = load_tasks_jsonl(path)
    assert [t.data for t in tasks] == [{"prompt": "p", "data": "some text"}, {"data": [1, 2]},
                                       {"prompt": "q", "data": {"source": "gsm8k"}}, {"prompt": "r"}]
    assert tasks[3].id == "c"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TaskFileError, match="task file not found"):
        load_tasks_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks_jsonl(_file(tmp_path, ["", ""]))


def test_an_endless_line_is_an_error_not_a_read_of_everything(tmp_path, monkeypatch):
    import saorl.data.tasks as tasks

    monkeypatch.setattr(tasks, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a"}\n' + "x" * 5000)  # a second line with no end, over the bound
    with pytest.raises(TaskFileError, match=r"t.jsonl:2: a line longer than"):
        load_tasks_jsonl(path)
    path.write_text('{"id": "a", "q": "' + "y" * 900 + '"}\n')  # under the bound: read
    assert [t.id for t in load_tasks_jsonl(path)] == ["a"]


def test_a_fifo_or_a_device_is_refused_before_it_is_opened(tmp_path):
    import os

    from saorl.data.tasks import read_tasks

    os.mkfifo(tmp_path / "p.jsonl")
    with pytest.raises(TaskFileError, match="a FIFO"):
        read_tasks(tmp_path / "p.jsonl")
    with pytest.raises(TaskFileError, match="a device"):
        read_tasks("/dev/zero")


def _write_tasks(path, ids):
    path.write_text("".join(json.dumps({"id": i, "question": "1+1", "answer": 2}) + "\n" for i in ids))
    return path


def test_a_single_tasks_file_holds_out_its_tail_for_every_stage(tmp_path):
    """SFT demonstrations, value-pretraining rollouts and RL prompts all come from the train split,
    which never shares a task with the test split (the bug: the test split came from the env's
    generator and the stages took the first n of the same file)."""
    from saorl.config import load_config
    from saorl.data.tasks import load_split
    from saorl.envs.registry import make_env_factory
    from saorl.runtime.parts import build_tasks
    from saorl.stages.evaluate import eval_tasks

    path = _write_tasks(tmp_path / "tasks.jsonl", [f"t{i}" for i in range(30)])
    cfg = load_config(None, [f"env.tasks_file={path}", "env.num_test_tasks=8", "env.num_train_tasks=100"])
    factory = make_env_factory(cfg.env.type, cfg.env.options)
    train, test = build_tasks(cfg, factory)
    assert [t.id for t in test] == [f"t{i}" for i in range(22, 30)]
    assert [t.id for t in train] == [f"t{i}" for i in range(22)]
    sft_tasks = load_split(factory(), cfg.env, "train", cfg.sft.num_demos, 7919)  # as the SFT stage asks
    vp_tasks = load_split(factory(), cfg.env, "train", 64, 15485863)  # as value pretraining asks
    test_ids = {t.id for t in test}
    assert not test_ids & {t.id for t in sft_tasks} and not test_ids & {t.id for t in vp_tasks}
    assert [t.id for t in eval_tasks(cfg, factory, "test", 5)] == [f"t{i}" for i in range(22, 27)]


def test_a_test_file_is_the_test_split_and_may_share_no_id(tmp_path):
    from saorl.config import load_config
    from saorl.envs.registry import make_env_factory
    from saorl.runtime.parts import build_tasks

    train_path = _write_tasks(tmp_path / "train.jsonl", ["a", "b", "c"])
    test_path = _write_tasks(tmp_path / "test.jsonl", ["x", "y"])
    cfg = load_config(None, [f"env.tasks_file={train_path}", f"env.test_tasks_file={test_path}"])
    train, test = build_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options))
    assert [t.id for t in train] == ["a", "b", "c"] and [t.id for t in test] == ["x", "y"]
    _write_tasks(test_path, ["x", "b"])
    with pytest.raises(TaskFileError, match=r"in both the train split .* e\.g\. 'b'"):
        build_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options))


def test_a_file_too_short_to_hold_out_from_is_a_clear_error(tmp_path):
    from saorl.data.tasks import load_tasks

    path = _write_tasks(tmp_path / "tasks.jsonl", ["a", "b"])
    with pytest.raises(TaskFileError, match="2 tasks, but 2 are held out"):
        load_tasks(None, "train", None, 0, path, held_out=2)


def test_a_test_file_without_a_train_file_fails_at_load():
    from saorl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"env.test_tasks_file: needs env.tasks_file"):
        load_config(None, ["env.test_tasks_file=x.jsonl"])


def test_env_test_seed_fixes_the_held_out_tasks_across_run_seeds():
    """By default each run seed draws its own held-out tasks; with ``env.test_seed`` every seed is
    evaluated on the same ones, its train tasks still its own and disjoint from them."""
    from saorl.config import load_config
    from saorl.envs.registry import make_env_factory
    from saorl.runtime.parts import build_tasks
    from saorl.stages.evaluate import eval_tasks

    def splits(*overrides):
        cfg = load_config(None, ["env.type=math_tool", "env.num_train_tasks=40", "env.num_test_tasks=16",
                                 *overrides])
        factory = make_env_factory(cfg.env.type, cfg.env.options)
        train, test = build_tasks(cfg, factory)
        assert [t.id for t in eval_tasks(cfg, factory, "test", 16)] == [t.id for t in test]
        return [t.id for t in train], [t.id for t in test]

    train0, test0 = splits("seed=0")
    train1, test1 = splits("seed=1")
    assert test0 != test1 and train0 != train1
    fixed0 = splits("seed=0", "env.test_seed=7")
    fixed1 = splits("seed=1", "env.test_seed=7")
    assert fixed0[1] == fixed1[1] == splits("seed=7")[1]
    assert fixed0[0] == train0 and fixed1[0] == train1  # the train tasks follow the run's seed
    assert not set(fixed1[1]) & set(train1)
