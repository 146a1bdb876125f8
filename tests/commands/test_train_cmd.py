"""``saorl train``: every start-up problem is one paragraph with the fix, status 2 and no run
directory left behind; a run that fails is status 3; a bug is status 1; no traceback without --debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import saorl.training
from saorl.cli import main
from saorl.commands.common import exit_status
from saorl.errors import RunFailure
from saorl.runtime.backends.local import WorkerFailure

# quick enough to train a step or two in-process, if a case got that far
FAST = ["model.policy=tiny-dense", "value_pretrain.enabled=false", "runtime.backend=inprocess",
        "env.num_test_tasks=4", "run.eval_tasks=2", "run.progress=false", "rollout.max_new_tokens=8",
        "rollout.max_total_tokens=64", "trainer.steps=2"]

ENV_MODULE = textwrap.dedent('''
    from saorl.envs.base import Env, StepResult, Task

    class Flaky(Env):
        """Fine on test tasks; every training episode raises (an env bug that only training meets)."""
        stop_strings = ("\\n",)

        def generate_tasks(self, split, n, seed):
            return [Task(f"{split}-{i}", {"split": split}) for i in range(n)]

        def reset(self, task, progress=None):
            self.task = task
            return "say something\\n"

        def step(self, action):
            if self.task.data["split"] == "train":
                raise ZeroDivisionError("the env divided by zero")
            return StepResult("", 0.0, True, {"success": False})

    class Broken(Flaky):
        """Every episode raises, evaluation included."""

        def step(self, action):
            raise ZeroDivisionError("the env divided by zero")
''')


@pytest.fixture(autouse=True)
def _no_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache and no Hub access, as on a machine without network."""
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "cli_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cli_envs"
    sys.modules.pop("cli_envs", None)


def _run(capsys, tmp_path, *args: str) -> tuple[int, str, str]:
    rc = main(["train", *FAST, f"run.out_dir={tmp_path / 'runs'}", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _no_run_directory(tmp_path: Path) -> bool:
    runs = tmp_path / "runs"
    return not runs.exists() or not [p for p in runs.iterdir() if p.name != ".cache"]


def _tasks(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _math_rows(n: int) -> list[dict]:
    from saorl.envs.registry import make_env_factory

    return [{"id": t.id, **t.data} for t in make_env_factory("math_tool")().generate_tasks("train", n, 0)]


def _malformed(d: Path) -> list[str]:
    return [f"env.tasks_file={_tasks(d / 't.jsonl', [_math_rows(1)[0], '{oops'])}"]


def _bad_payload(d: Path) -> list[str]:
    rows = _math_rows(12)
    rows[5] = {"id": "x", "q": 1}  # row 6, in the training part of the file
    return [f"env.tasks_file={_tasks(d / 't.jsonl', rows)}"]


def _fifo(d: Path) -> list[str]:
    os.mkfifo(d / "pipe.jsonl")  # no writer: an open() for reading would block forever
    return [f"env.tasks_file={d / 'pipe.jsonl'}"]


CASES = {
    "tasks file is a FIFO with no writer": (_fifo, ["pipe.jsonl: a FIFO (named pipe)", "regular file"]),
    "tasks file is /dev/zero": (lambda d: ["env.tasks_file=/dev/zero"], ["/dev/zero: a device"]),
    "missing tasks file": (lambda d: [f"env.tasks_file={d / 'missing.jsonl'}"],
                           ["missing.jsonl: task file not found", "env.tasks_file"]),
    "malformed tasks file": (_malformed, ["t.jsonl:2: malformed JSON"]),
    "payload the env rejects": (_bad_payload,
                                ["t.jsonl: row 6 (task id 'x')", "rejects this task", "fix the row"]),
    "env without demonstrations": (lambda d: ["env.type=synthetic", "sft.enabled=true"],
                                   ["has no demonstrations", "sft.enabled=false"]),
    "hub id not in the cache, offline": (lambda d: ["model.policy=saorl-tests/not-cached"],
                                         ["not in the local Hugging Face cache",
                                          "hf download saorl-tests/not-cached --local-dir DIR"]),
    "non-model directory as policy": (lambda d: [f"model.policy={d}"],
                                      ["has no config.json", "save_pretrained"]),
    "missing critic": (lambda d: [f"model.critic={d / 'critic'}", "sft.enabled=false"],
                       ["does not exist", "model.critic=null"]),
    "missing env module": (lambda d: ["env.type=no_such_pkg.envs:MyEnv"],
                           ["no module named 'no_such_pkg'", "PYTHONPATH"]),
    "missing env class": (lambda d: ["env.type=saorl.envs.math_tool:NoSuchEnv"],
                          ["has no attribute 'NoSuchEnv'"]),
    "bad env options": (lambda d: ["env.options.colour=red"],
                        ["unknown options: ['colour']", "accepts: family"]),
    "grpo alone": (lambda d: ["algo.name=grpo"], ["trainer.batch_size=8"]),
    "run name too long for a file system": (lambda d: ["run.name=" + "n" * 300],
                                            ["run.name", "must be at most 200 bytes"]),
}
NOT_LOADED = {"grpo alone", "run name too long for a file system"}  # config errors: no run directory named


@pytest.mark.parametrize("case", sorted(CASES))
def test_start_up_errors_are_one_paragraph_exit_2_and_leave_no_run_directory(case, tmp_path, capsys):
    overrides, expected = CASES[case]
    rc, out, err = _run(capsys, tmp_path, "sft.enabled=false", *overrides(tmp_path))
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    assert _no_run_directory(tmp_path)
    if case not in NOT_LOADED:  # the config loaded, so the run directory was announced before any check
        assert out.startswith("run directory: ")  # and then said not kept
        assert out.strip().splitlines()[-1].endswith(" not kept (the run did not start)"), out


def test_cuda_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = _run(capsys, tmp_path, "sft.enabled=false", "model.device=cuda")
    assert rc == 2 and "torch sees no CUDA device" in err and "model.device=cpu" in err
    assert _no_run_directory(tmp_path)


def test_a_failure_after_the_parts_are_built_removes_the_new_run_directory(tmp_path, capsys, monkeypatch):
    class Boom(Exception):
        pass

    def broken_run(*args, **kwargs):
        raise Boom("the run could not be set up")

    monkeypatch.setattr(saorl.training, "build_run", broken_run)
    run_dir = tmp_path / "runs" / "mine"
    rc = main(["train", *FAST, "sft.enabled=false", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 1 and "unexpected error: Boom: the run could not be set up" in err and "--debug" in err
    assert "Traceback" not in err and not run_dir.exists()
    # a directory the user made is theirs: left in place
    run_dir.mkdir(parents=True)
    assert main(["train", *FAST, "sft.enabled=false", "--run-dir", str(run_dir)]) == 1
    assert run_dir.is_dir()
    capsys.readouterr()
    assert main(["--debug", "train", *FAST, "sft.enabled=false", "--run-dir", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "Boom" in err and "--debug" not in err


def test_a_rollout_that_keeps_failing_is_a_run_failure_exit_3(tmp_path, capsys, env_module):
    rc, out, err = _run(capsys, tmp_path, "sft.enabled=false", f"env.type={env_module}:Flaky")
    assert rc == 3, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("saorl train: the run failed: ") and "failed 4 times" in last
    assert "Traceback" not in err and "(traceback in errors.log)" in err
    run_dir = Path(out.splitlines()[0].removeprefix("run directory: "))
    log = (run_dir / "errors.log").read_text()  # the env's traceback is kept, in the run directory
    assert "Traceback (most recent call last)" in log and "ZeroDivisionError: the env divided by zero" in log


def test_an_env_bug_in_evaluation_is_a_run_failure_without_the_traceback(tmp_path, capsys, env_module):
    """An env that raises in the step-0 evaluation (nothing retries it) fails the run as a training
    rollout that keeps failing does: exit 3, never "a bug in saorl" (issue #25: the same exit code
    wherever a user's code trips)."""
    rc, _, err = _run(capsys, tmp_path, "sft.enabled=false", f"env.type={env_module}:Broken")
    assert rc == 3 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]  # before it: one line per failed training rollout
    assert last.startswith("saorl train: the run failed: ")
    assert "ZeroDivisionError: the env divided by zero" in last


def test_exit_statuses():
    assert exit_status(WorkerFailure("worker 0 died"), "saorl train")[0] == 3
    assert exit_status(RunFailure("journal damaged"), "saorl train") == (
        3, "saorl train: the run failed: journal damaged")
    assert exit_status(KeyboardInterrupt(), "saorl train") == (130, "saorl train: interrupted")
    worker_error = ValueError("x\nTraceback (most recent call last):\n  File ...")
    status, message = exit_status(worker_error, "saorl eval")
    assert status == 1 and "Traceback" not in message and "\n" not in message


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cwd / "hf-cache")}
    return subprocess.run([sys.executable, "-m", "saorl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **offline, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["model.policy=saorl-tests/not-cached"], "hf download saorl-tests/not-cached --local-dir DIR"),
    (["env.type=no_such_pkg.envs:MyEnv"], "no module named 'no_such_pkg'"),
])
def test_a_real_process_prints_one_paragraph_and_exits_2(tmp_path, args, expected):
    r = _cli("train", *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert expected in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout.startswith("run directory: runs/") and not (tmp_path / "runs").exists()
    assert set(p.name for p in tmp_path.iterdir()) <= {"hf-cache"}


@pytest.mark.slow
def test_saorl_debug_shows_the_traceback(tmp_path):
    r = _cli("train", "env.type=no_such_pkg.envs:MyEnv", cwd=tmp_path, env={"SAORL_DEBUG": "1"})
    assert r.returncode == 2 and "Traceback (most recent call last)" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("saorl train: env.type: ")


@pytest.mark.slow
def test_run_dir_first_no_library_bars_absolute_paths_and_resume_from_elsewhere(tmp_path):
    """A real ``saorl train`` from one directory with relative paths, resumed from another."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    _tasks(here / "tasks.jsonl", _math_rows(24))
    sft = ["sft.enabled=true", "sft.steps=2", "sft.num_demos=4", "sft.batch_size=2"]
    r = _cli("train", *FAST, *sft, "env.tasks_file=tasks.jsonl", "run.checkpoint_every=1", cwd=here)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("run directory: runs/sao-math_tool-")
    assert any(line.startswith("sft: ") for line in lines[1:])  # the warm start came after it
    for bar in ("Writing model shards", "Loading weights", "Traceback"):
        assert bar not in r.stdout + r.stderr
    run_dir = here / lines[0].removeprefix("run directory: ")
    saved = (run_dir / "config.yaml").read_text()
    assert f"out_dir: {here / 'runs'}" in saved and f"tasks_file: {here / 'tasks.jsonl'}" in saved
    r = _cli("train", "--resume", str(run_dir), "trainer.steps=3", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "sft: using the cached warm start" in r.stdout  # same (absolute) cache key
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("step", 0) > 0] == [1, 2, 3]  # (row 0: the step-0 evaluation)
    assert [r["resume"]["from_step"] for r in rows if "resume" in r] == [2]  # the resume's marker row
    assert not (elsewhere / "runs").exists()


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    from saorl.cli import main

    run_dir = tmp_path / "run"
    args = ["sft.enabled=false", "value_pretrain.enabled=false", "runtime.backend=inprocess",
            "trainer.steps=2", "run.eval_tasks=2", "env.num_test_tasks=4", "run.progress=false",
            "rollout.max_new_tokens=8", "rollout.max_total_tokens=64"]
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "already trained to step 2 (trainer.steps=2)" in out and "trainer.steps=4" in out
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # nothing written, the lock released


@pytest.mark.parametrize("command", ["config", "train"])
def test_an_env_option_typo_is_refused_before_torch_is_imported(command, tmp_path):
    """saorl config and saorl train run the same env check, before any tensor library loads."""
    import json
    import subprocess
    import sys

    argv = ["saorl", command, "env.options.difficulty_level=2"]
    argv += ["--run-dir", str(tmp_path / "run")] if command == "train" else []
    probe = (f"import sys, runpy; sys.argv = {json.dumps(argv)}\ncode = 0\ntry:\n"
             "    runpy.run_module('saorl.cli', run_name='__main__')\nexcept SystemExit as e:\n"
             "    code = e.code\nprint('TORCH', 'torch' in sys.modules); sys.exit(code)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "difficulty_level" in res.stderr and "MathToolEnv accepts: family" in res.stderr
    assert "TORCH False" in res.stdout and not (tmp_path / "run").exists()


def test_ray_killing_a_process_for_memory_is_a_run_failure_naming_memory_exit_3(tmp_path, capsys,
                                                                               monkeypatch):
    """The issue's case: Ray's memory monitor killed a worker and the run ended as "a bug", exit 1.
    The exception Ray raises then (ray.exceptions.OutOfMemoryError, built by ray._private.serialization
    for an OUT_OF_MEMORY error), raised out of the run's second step, is classified as a run that had
    to stop: exit 3, memory named, the resume pointed at, step 1's checkpoint kept."""
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from saorl.runtime.run import Run

    real_step, calls = Run._train_step, []

    def step_then_oom(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise ray_exceptions.OutOfMemoryError(
                "Task was killed due to the node running low on memory. Memory on the node was 7.40GB / "
                "7.70GB (0.961), which exceeds the memory usage threshold of 0.95.")
        return real_step(self, *args)

    monkeypatch.setattr(Run, "_train_step", step_then_oom)
    run_dir = tmp_path / "run"
    rc = main(["train", *FAST, "sft.enabled=false", "trainer.steps=3", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "ran out of memory (OutOfMemoryError: Task was killed" in err and "--resume" in err, err
    assert "bug" not in err
    assert (run_dir / "checkpoints" / "latest").exists()
