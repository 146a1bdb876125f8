"""env.prepare: a recipe whose data is generated makes it on first use, once; a command that fails
or writes the wrong file stops the start in one paragraph naming it."""

from __future__ import annotations

import threading

import pytest

from saorl.config import load_config
from saorl.errors import StartupError
from saorl.stages.env_check import prepare_tasks

MAKE = """import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
d.mkdir(parents=True)
for name in ("train.jsonl", "test.jsonl"):
    (d / name).write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\\n")
print("wrote", d)
"""


def _cfg(prepare):
    cfg = load_config(None, ["env.type=prompt_reward",
                             "env.options.reward_fn=saorl.envs.rewards:number_answer",
                             "env.tasks_file=data/sums/train.jsonl",
                             "env.test_tasks_file=data/sums/test.jsonl"])
    cfg.env.prepare = prepare
    return cfg


def test_missing_task_files_are_made_once_by_env_prepare(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = []
    (tmp_path / "make_data.py").write_text(MAKE)
    cfg = _cfg("python make_data.py data/sums")
    prepare_tasks(cfg, log=said.append)
    assert (tmp_path / "data/sums/test.jsonl").read_text() == '{"prompt": "1+1=", "answer": 2}\n'
    assert said == ["env.tasks_file data/sums/train.jsonl is missing: making the task files with "
                    f"`{cfg.env.prepare}` (env.prepare, once)", "wrote data/sums"]
    prepare_tasks(cfg, log=said.append)  # there now: not run again (mkdir would fail)
    assert len(said) == 2


@pytest.mark.parametrize("prepare, expected", [
    ("python -c \"raise SystemExit('no network here')\"", "failed (exit 1) in"),
    ("python -c \"print('made nothing')\"", "ran but env.tasks_file data/sums/train.jsonl is still missing "
                                            "(it said: made nothing)"),
    ("no-such-generator-xyz data/sums", "could not run"),
])
def test_a_command_that_fails_or_makes_nothing_is_named(tmp_path, monkeypatch, prepare, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StartupError) as info:
        prepare_tasks(_cfg(prepare), log=lambda text: None)
    msg = str(info.value)
    assert "\n" not in msg and expected in msg and "env.prepare" in msg, msg
    if "failed" in expected:
        assert "no network here" in msg


def test_under_torchrun_only_rank_0_runs_it_the_others_wait_for_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    cfg = _cfg("python -c \"import pathlib; pathlib.Path('ran').touch()\"")

    def rank0():
        for name in ("train.jsonl", "test.jsonl"):
            (tmp_path / "data/sums").mkdir(parents=True, exist_ok=True)
            (tmp_path / "data/sums" / name).write_text("{}\n")

    timer = threading.Timer(0.3, rank0)
    timer.start()
    said = []
    prepare_tasks(cfg, log=said.append)  # returns once rank 0's files are there
    timer.join()
    assert not (tmp_path / "ran").exists() and said == []


def test_the_start_up_checks_make_them_too_so_sft_and_value_pretraining_find_them(tmp_path, monkeypatch):
    """``saorl sft`` and ``saorl value_pretrain`` start with :func:`check_run`, not with ``saorl
    train``'s own call: the checks make the files before reading the tasks."""
    from saorl.stages.preflight import check_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "make_data.py").write_text(MAKE.replace('"1+1=", "answer": 2', 'name, "answer": 2'))
    cfg = _cfg("python make_data.py data/sums")  # a row per split, told apart by the prompt
    cfg.sft.enabled = False
    said = []
    check_run(cfg, demonstrations=False, log=said.append)
    assert (tmp_path / "data/sums/train.jsonl").exists() and (tmp_path / "data/sums/test.jsonl").exists()
    cfg.env.prepare = None  # without the command the missing file is named, as before
    (tmp_path / "data/sums/train.jsonl").unlink()
    with pytest.raises(StartupError, match=r"train\.jsonl: task file not found"):
        check_run(cfg, demonstrations=False, log=said.append)
