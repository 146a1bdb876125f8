"""The run directory: a fresh run refuses an old one, a resume needs a run, one trainer at a time,
a crash's temporaries removed; resume markers make the audit trail count each rollout once."""

import json
import subprocess
import sys

import pytest

from saorl.runtime.recorder import effective_rows
from saorl.runtime.rundir import RunDirError, check_not_in_use, claim_run_dir, remove_temporaries


def test_a_fresh_run_takes_only_a_new_or_empty_directory(tmp_path):
    claim_run_dir(tmp_path / "new", resume=False).release()
    (tmp_path / "empty").mkdir()
    claim_run_dir(tmp_path / "empty", resume=False).release()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError) as e:
        claim_run_dir(tmp_path / "old", resume=False)
    msg = str(e.value)
    assert f"saorl train --resume {tmp_path / 'old'}" in msg and "metrics.jsonl" in msg and "\n" not in msg
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["metrics.jsonl"]  # untouched
    claim_run_dir(tmp_path / "new", resume=False).release()  # a lone .lock (a start killed before it
    held = claim_run_dir(tmp_path / "new", resume=False)      # wrote anything) counts as empty...
    with pytest.raises(RunDirError, match="is in use"):      # ...unless a live process holds it
        claim_run_dir(tmp_path / "new", resume=False)
    held.release()


def test_a_resume_needs_a_run_directory(tmp_path):
    with pytest.raises(RunDirError, match=r"no config\.yaml"):
        claim_run_dir(tmp_path, resume=True)


def test_a_second_trainer_in_the_same_directory_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    lock = claim_run_dir(tmp_path, resume=True)
    code = (f"from pathlib import Path; from saorl.runtime.rundir import claim_run_dir, RunDirError\n"
            f"try:\n    claim_run_dir(Path({str(tmp_path)!r}), resume=True)\n"
            f"except RunDirError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "in use by another saorl process" in out
    lock.release()  # and once the first lets go (or dies), the directory can be claimed
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == ""


def test_a_resume_of_a_directory_in_use_is_refused_before_the_trainer_is_imported(tmp_path):
    """The holder is another process; ``saorl train --resume`` refuses before it imports torch
    (seconds on a busy machine), and the probe writes nothing."""
    (tmp_path / "config.yaml").write_text("{}\n")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from saorl.runtime.rundir import claim_run_dir; "
                               f"lock = claim_run_dir(Path({str(tmp_path)!r}), resume=True); "
                               "print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        content = (tmp_path / ".lock").read_text()
        with pytest.raises(RunDirError, match="in use by another saorl process"):
            check_not_in_use(tmp_path)
        code = ("import sys; from saorl.cli import main; rc = main(['train', '--resume', sys.argv[1]]); "
                "print('torch' in sys.modules); sys.exit(rc)")
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
        assert r.returncode == 2 and r.stdout == "False\n", (r.stdout, r.stderr)
        assert "in use by another saorl process" in r.stderr and r.stderr.count("\n") == 1
        assert (tmp_path / ".lock").read_text() == content
    finally:
        holder.communicate("")
    check_not_in_use(tmp_path)  # the holder is gone: the lock with it


def test_temporaries_of_a_crash_are_removed_and_nothing_else(tmp_path):
    keep = ["config.yaml", "checkpoints/latest", "checkpoints/step-00000004/manifest.json",
            "weights/v00000004.safetensors", "weights/latest.json", "journal/seg-00000001.jsonl", ".lock"]
    junk = ["checkpoints/.tmp-step-00000006-1234/policy.safetensors", "checkpoints/.latest.tmp1234",
            "weights/.v00000005.safetensors.tmp-1234-abcd", "weights/.latest.json.tmp1234",
            "config.yaml.tmp", "final/.policy.tmp-x1y2/config.json", "final/.critic.old-1a2b/critic.json"]
    for rel in keep + junk:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    removed = remove_temporaries(tmp_path)
    assert removed == ["checkpoints/.latest.tmp1234", "checkpoints/.tmp-step-00000006-1234",
                       "config.yaml.tmp", "final/.critic.old-1a2b", "final/.policy.tmp-x1y2",
                       "weights/.latest.json.tmp1234", "weights/.v00000005.safetensors.tmp-1234-abcd"]
    assert all((tmp_path / rel).exists() for rel in keep)
    assert not any((tmp_path / rel).exists() for rel in junk)


def test_effective_rows_drop_the_steps_a_resume_redid():
    rows = [{"step": 1, "rids": [0]}, {"step": 2, "rids": [1]}, {"step": 3, "rids": [2]},
            {"resume": {"from_step": 1}}, {"step": 2, "rids": [3]}, {"step": 3, "rids": [1]},
            {"resume": {"from_step": 3}}, {"step": 4, "rids": [2]}]
    assert [(r["step"], r["rids"]) for r in effective_rows(json.loads(json.dumps(rows)))] == [
        (1, [0]), (2, [3]), (3, [1]), (4, [2])]


@pytest.mark.parametrize("cached", [False, True])
def test_the_run_directory_exists_during_the_warm_start_and_a_failed_start_removes_it(tmp_path, monkeypatch,
                                                                                       cached):
    """``saorl train`` prints the run directory first: it exists (and is locked) while the warm start
    runs; a start that fails then removes it, and the ``runs/`` it created unless a stage cached
    something there."""
    import saorl.training as training
    from saorl.config import load_config

    out = tmp_path / "runs"
    run_dir = out / "sao-x"
    seen = []

    def warm_start(cfg, log=print, shelf=None):
        seen.append((run_dir.is_dir(), (run_dir / ".lock").is_file()))
        if cached:
            (out / ".cache" / "sft-key").mkdir(parents=True)
        raise KeyboardInterrupt  # Ctrl-C during the warm start

    monkeypatch.setattr(training, "warm_start", warm_start)
    cfg = load_config(None, [f"run.out_dir={out}", "runtime.backend=inprocess"])
    with pytest.raises(KeyboardInterrupt):
        training.train(cfg, run_dir)
    assert seen == [(True, True)]
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ([".cache", "runs", "sft-key"] if cached else [])
