"""Fault injection: kill -9 at random points over several cycles, damaged files, non-finite updates.

Each case is checked from the run directory alone, as an auditor would: ``trained.jsonl`` with
its resume markers applied (:func:`effective_rows`), the final checkpoint's finished set and
pending trajectories, the journal read before every resume. The random points come from a seed
printed on failure; ``SAORL_FAULT_SEED=N`` replays one.
"""

import json
import os
import random
import shutil
import signal
import time

import pytest
import torch
from runtime_helpers import (
    BASE,
    audit_exactly_once,
    journalled_rids,
    read_jsonl,
    resume_train,
    rollout_worker_pids,
    start_train,
    step_rows,
    wait_for_steps,
    wait_until_gone,
)
from safetensors.torch import load_file

from saorl.cli import main
from saorl.runtime.recorder import effective_rows

pytestmark = pytest.mark.slow


def _kill(proc, run_dir, victim: str, rng: random.Random, log) -> None:
    if victim == "worker, then trainer":
        workers = rollout_worker_pids(proc.pid)
        assert workers, log.read_text()[-2000:]
        os.kill(workers[0], signal.SIGKILL)
        wait_for_steps(proc, run_dir, step_rows(run_dir) + 1, log)  # it is restarted, training goes on
        time.sleep(rng.uniform(0, 0.5))
    if victim == "whole process group":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGKILL)  # the trainer alone: its workers must not outlive it
    proc.wait()


def test_kill_9_at_random_points_trains_every_journalled_rollout_exactly_once(tmp_path):
    seed = int(os.environ.get("SAORL_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    run_dir, journalled = tmp_path / "run", set()
    victims = rng.sample(["trainer", "worker, then trainer", "whole process group"], 3)
    for cycle, victim in enumerate(victims):
        why = f"cycle {cycle} ({victim}), SAORL_FAULT_SEED={seed}"
        log = tmp_path / f"log-{cycle}.txt"
        proc = (start_train(run_dir, "trainer.steps=1000", "run.checkpoint_every=2", log=log) if cycle == 0
                else resume_train(run_dir, log=log))
        try:
            wait_for_steps(proc, run_dir, step_rows(run_dir) + rng.randint(1, 4), log)
            time.sleep(rng.uniform(0, 1.0))  # mid-step, mid-checkpoint, mid-journal-write: wherever
            _kill(proc, run_dir, victim, rng, log)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        left = wait_until_gone(proc.pid, 10.0)
        assert not left, f"processes outlived the trainer by 10 s: {left}; {why}"
        journalled |= journalled_rids(run_dir)
    steps = len(effective_rows(read_jsonl(run_dir / "trained.jsonl"))) + 3
    log = tmp_path / "log-final.txt"
    proc = resume_train(run_dir, f"trainer.steps={steps}", log=log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert not wait_until_gone(proc.pid, 10.0)
    audit_exactly_once(run_dir, steps, len(victims), journalled, f"SAORL_FAULT_SEED={seed}")


# ------------------------------------------------------------------ damaged files, one process
# sync: each step's rollouts are sampled after the step before it, so steps 3 and 4 journal
# rollouts after step 2's checkpoint whatever the load (async, a slow trainer could train them all
# from what was already pending at the checkpoint, leaving the journal after it empty)
INPROC = [*BASE, "runtime.backend=inprocess", "run.checkpoint_every=2", "runtime.mode=sync"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A clean 4-step run with checkpoints at steps 2 and 4 (the template each case damages)."""
    run_dir = tmp_path_factory.mktemp("template") / "run"
    assert main(["train", *INPROC, "trainer.steps=4", "--run-dir", str(run_dir)]) == 0
    return run_dir


def _copy(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints"


def _flip_tensor_byte(path):
    data = bytearray(path.read_bytes())
    data[-50] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_falls_back_and_each_rollout_is_still_trained_once(finished_run, tmp_path,
                                                                                 capsys):
    run_dir, ckpts = _copy(finished_run, tmp_path)
    journalled = journalled_rids(run_dir)
    _flip_tensor_byte(ckpts / "step-00000004" / "policy.safetensors")
    (ckpts / ".tmp-step-00000006-999").mkdir()  # and what a crash mid-checkpoint leaves
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 0
    err = capsys.readouterr().err
    assert str(ckpts / "step-00000004" / "policy.safetensors") in err and "step-00000002" in err
    assert "checkpoints/.tmp-step-00000006-999" in err and not (ckpts / ".tmp-step-00000006-999").exists()
    marker = [r for r in read_jsonl(run_dir / "trained.jsonl") if "resume" in r]
    assert [m["resume"]["from_step"] for m in marker] == [2]
    assert (ckpts / "damaged-step-00000004").is_dir()
    audit_exactly_once(run_dir, 6, 1, journalled, "fallback from a damaged step-4")


def _resume_fails(run_dir, capsys, *overrides) -> str:
    assert main(["train", "--resume", str(run_dir), *overrides]) == 3
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("saorl train: ")
    return err.splitlines()[-1]


def test_damage_with_no_way_around_stops_with_one_paragraph(finished_run, tmp_path, capsys):
    run_dir, ckpts = _copy(finished_run, tmp_path)
    (ckpts / "step-00000004" / "manifest.json").unlink()
    msg = _resume_fails(run_dir, capsys, "run.resume_fallback=false")
    assert str(ckpts / "step-00000004" / "manifest.json") in msg and "step-00000002" in msg
    # step-2 is intact, but the journal after it has a damaged line (the middle one of the fullest
    # segment it reads: how many rollouts arrived after its checkpoint depends on the machine's load)
    seg = json.loads((ckpts / "step-00000002" / "manifest.json").read_text())["journal_segment"]
    segs = [p for p in (run_dir / "journal").glob("seg-*.jsonl") if int(p.stem.split("-")[1]) >= seg]
    path = max(segs, key=lambda p: len(p.read_text().splitlines()))
    lines = path.read_text().splitlines(keepends=True)
    assert lines, "rollouts should have arrived after the step-2 checkpoint"
    n = len(lines) // 2
    lines[n] = lines[n].replace('"rid":', '"rid": ', 1)  # one character more: valid JSON, wrong bytes
    path.write_text("".join(lines))
    msg = _resume_fails(run_dir, capsys)
    assert f"journal {path}, line {n + 1} of {len(lines)}" in msg
    shutil.rmtree(ckpts / "step-00000002")  # and with no checkpoint left: never a restart from step 0
    (ckpts / "latest").write_text("step-00000004")
    msg = _resume_fails(run_dir, capsys)
    assert "no intact earlier checkpoint" in msg
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]  # nothing appended


def test_a_stray_segment_or_a_directory_segment_is_named_as_it_is(finished_run, tmp_path, capsys):
    run_dir, _ = _copy(finished_run, tmp_path)
    journal = run_dir / "journal"
    newest = max(journal.glob("seg-*.jsonl"))
    (journal / "seg-00000099.jsonl").write_bytes(b"\x00garbage\n" * 10)  # past a gap, named by no checkpoint
    msg = _resume_fails(run_dir, capsys, "trainer.steps=6")
    assert f"journal segment {journal / 'seg-00000099.jsonl'} follows a gap" in msg, msg
    assert "stray file" in msg and "is missing" not in msg
    # said once, and the intact checkpoints are not called damaged
    assert msg.count("follows a gap") == 1 and "damaged" not in msg and "not at fault" in msg, msg
    latest = run_dir / "checkpoints" / "latest"
    pointer = latest.read_text()
    latest.unlink()  # the fallback's search over the checkpoints says it the same way
    msg = _resume_fails(run_dir, capsys, "trainer.steps=6")
    assert msg.count("follows a gap") == 1 and "damaged" not in msg, msg
    latest.write_text(pointer)
    (journal / "seg-00000099.jsonl").unlink()
    newest.unlink()
    newest.mkdir()  # a segment replaced by a directory: damage named, not a bug (status 1)
    msg = _resume_fails(run_dir, capsys, "trainer.steps=6")
    assert f"journal segment {newest} is not a file" in msg, msg
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]  # nothing appended


def _files(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}  # (.lock holds the pid of its last holder)


def test_checkpoints_and_journal_deleted_stop_the_resume_unless_restart_asks(finished_run, tmp_path, capsys,
                                                                          monkeypatch):
    """The adversarial user's case: checkpoints/ and journal/ deleted after the run trained. The
    resume stops at once (before the start-up checks), exit 3, naming the record; `--restart` trains
    from step 0 again, behind a resume marker that says so."""
    import saorl.training

    run_dir, ckpts = _copy(finished_run, tmp_path)
    shutil.rmtree(ckpts)
    shutil.rmtree(run_dir / "journal")
    before = _files(run_dir)
    checks = []
    monkeypatch.setattr(saorl.training, "check_run", lambda cfg: checks.append(cfg))
    t0 = time.monotonic()
    assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 3
    took = time.monotonic() - t0
    msg = capsys.readouterr().err.strip()
    assert "\n" not in msg and msg.startswith("saorl train: the run failed: cannot resume: ")
    assert "trained.jsonl records 4 trained steps (the last, step 4)" in msg
    assert "metrics.jsonl has 4 step rows" in msg and "weights/ holds version 4" in msg
    assert f"saorl train --resume {run_dir} --restart" in msg
    assert checks == [] and took < 10, took  # refused before the start-up checks
    assert _files(run_dir) == before and not (run_dir / "journal").exists()  # nothing written
    monkeypatch.undo()
    assert main(["train", "--resume", str(run_dir), "--restart", "trainer.steps=2"]) == 0
    assert "--restart: " in capsys.readouterr().err
    rows = read_jsonl(run_dir / "trained.jsonl")
    marker = [r["resume"] for r in rows if "resume" in r]
    assert len(marker) == 1 and marker[0]["from_step"] == 0 and marker[0]["restart"] is True
    assert marker[0]["version"] > 4  # the versions go on above the published ones
    assert [r["step"] for r in effective_rows(rows)] == [1, 2]
    assert main(["train", "--restart", "trainer.steps=2"]) == 2  # --restart belongs to --resume
    assert "--restart goes with --resume" in capsys.readouterr().err


def test_a_second_trainer_is_refused_at_once(finished_run, tmp_path, capsys, monkeypatch):
    import saorl.training
    from saorl.runtime.rundir import claim_run_dir

    run_dir, _ = _copy(finished_run, tmp_path)
    lock = claim_run_dir(run_dir, resume=True)  # the first trainer (flock: another open file description)
    try:
        monkeypatch.setattr(saorl.training, "check_run", lambda cfg: pytest.fail("a slow check ran"))
        t0 = time.monotonic()
        assert main(["train", "--resume", str(run_dir), "trainer.steps=6"]) == 2
        assert time.monotonic() - t0 < 10
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert "is in use by another saorl process" in err and err.count("\n") == 1


def test_a_fresh_run_into_an_old_run_directory_is_refused(finished_run, tmp_path, capsys):
    run_dir, _ = _copy(finished_run, tmp_path)
    before = sorted(str(p) for p in run_dir.rglob("*"))
    assert main(["train", *INPROC, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"saorl train --resume {run_dir}" in err and "Traceback" not in err
    assert sorted(str(p) for p in run_dir.rglob("*")) == before


def test_non_finite_updates_stop_the_run_and_never_reach_disk(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["trainer.policy_lr=1e6", "trainer.steps=30", "--run-dir", str(run_dir)]
    assert main(["train", *INPROC, *args]) == 3
    err = capsys.readouterr().err
    assert "trainer.max_nonfinite_skips=3" in err and "Traceback" not in err
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    skips = [r["train/nonfinite_skips"] for r in rows]
    assert len(rows) < 30 and all(b > a for a, b in zip(skips[-4:], skips[-3:]))  # the last 3 skipped
    files = [*run_dir.glob("weights/*.safetensors"), *run_dir.glob("checkpoints/step-*/*.safetensors"),
             *run_dir.glob("final/policy/*.safetensors"), *run_dir.glob("final/critic/*.safetensors")]
    assert len(files) >= 5
    for f in files:
        assert all(torch.isfinite(t).all() for t in load_file(str(f)).values()), f
    # and a non-finite learning rate never gets that far
    assert main(["train", *INPROC, "trainer.policy_lr=.inf", "--run-dir", str(tmp_path / "b")]) == 2
    assert "trainer.policy_lr: Input should be a finite number" in capsys.readouterr().err
