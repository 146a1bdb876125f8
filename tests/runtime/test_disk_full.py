"""A full disk, a read-only run directory, a disk that fills mid-run: one paragraph naming the path
and the space, found at start-up where it can be, no half-written files left, nothing lost.

The real cases mount a small tmpfs (root only; skipped where ``mount`` is refused); the fake
error case runs everywhere."""

from __future__ import annotations

import errno
import subprocess
import time
from pathlib import Path

import pytest

from saorl.cli import main
from saorl.runtime.disk import checkpoint_bytes, disk_errno

FAST = ["model.policy=tiny-dense", "sft.enabled=false", "value_pretrain.enabled=false",
        "runtime.backend=inprocess", "runtime.mode=sync", "env.num_test_tasks=4", "run.eval_tasks=2",
        "run.progress=false", "rollout.max_new_tokens=8", "rollout.max_total_tokens=64", "trainer.steps=2",
        "trainer.batch_size=4", "run.report_to=none"]


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, read_only=False)`` → a fresh tmpfs of that many MiB, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size_mib: int, read_only: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        opts = f"size={size_mib}m" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _train(capsys, run_dir: Path, *args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    rc = main(["train", *FAST, f"run.out_dir={run_dir.parent}", *args, "--run-dir", str(run_dir)])
    return rc, capsys.readouterr().err.strip(), time.monotonic() - t0


def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err and "This is a bug" not in err, err
    return err.splitlines()[-1]


def test_a_read_only_run_directory_is_refused_at_start_up_in_a_second(tmpfs, capsys):
    ro = tmpfs(4, read_only=True)
    rc, err, took = _train(capsys, ro / "run", "sft.enabled=true")  # SFT would take minutes first
    msg = _one_paragraph(err)
    assert rc == 2 and took < 30, (took, err)  # (the imports; SFT alone would take minutes)
    assert f"the run directory {ro / 'run'} cannot be written" in msg and "read-only" in msg, msg


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_a_step(tmpfs, capsys):
    small = tmpfs(12)
    rc, err, _ = _train(capsys, small / "run")
    msg = _one_paragraph(err)
    assert rc == 2, err
    assert f"the run directory {small / 'run'} has" in msg and "MiB free" in msg, msg
    assert "one checkpoint of this run takes about" in msg, msg
    assert not (small / "run").exists()  # a failed start leaves nothing


@pytest.mark.slow
def test_a_disk_that_fills_at_a_checkpoint_stops_with_the_space_and_resumes_once_there_is_room(tmpfs, capsys):
    disk = tmpfs(30)  # room for the start-up check (a checkpoint, ~22 MiB), not for it and the weights
    run = disk / "run"
    rc, err, _ = _train(capsys, run)
    msg = _one_paragraph(err)
    assert rc == 3, err
    assert "the disk is full" in msg and f"free on the disk of {run}" in msg, msg
    assert "the next checkpoint needs about" in msg and f"saorl train --resume {run}" in msg, msg
    left = [p for p in run.rglob("*") if ".tmp" in p.name]
    assert not left, left  # the half-written checkpoint is gone
    subprocess.run(["mount", "-o", "remount,size=96m", str(disk)], check=True)
    rc = main(["train", "--resume", str(run)])
    assert rc == 0, capsys.readouterr().err
    assert (run / "checkpoints" / "step-00000002").is_dir() and (run / "final" / "policy").is_dir()


def test_a_failed_checkpoint_write_removes_its_temporary_and_is_one_paragraph(tmp_path, capsys, monkeypatch):
    """Without a mount: the learner's write fails as safetensors reports a full disk."""
    from saorl.runtime.learner.single import Learner

    def full(self, directory):
        (Path(directory) / "policy.safetensors").write_bytes(b"\0" * 1000)  # half-written
        raise RuntimeError("SafetensorError: Error while serializing: IoError(Os { code: 28, kind: "
                           "StorageFull, message: \"No space left on device\" })")

    monkeypatch.setattr(Learner, "save_state", full)
    rc, err, _ = _train(capsys, tmp_path / "run")
    msg = _one_paragraph(err)
    assert rc == 3 and "the disk is full" in msg and "the next checkpoint needs about" in msg, msg
    assert not [p for p in (tmp_path / "run").rglob("*") if ".tmp" in p.name]


def test_the_errno_is_read_out_of_any_wrapper():
    assert disk_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert disk_errno(OSError(errno.EROFS, "Read-only file system")) == errno.EROFS
    assert disk_errno(RuntimeError("IoError: File too large")) == errno.EFBIG
    try:
        try:
            raise OSError(errno.EDQUOT, "quota")
        except OSError as e:
            raise ValueError("wrapped") from e
    except ValueError as wrapped:
        assert disk_errno(wrapped) == errno.EDQUOT
    assert disk_errno(OSError(errno.ENOENT, "No such file")) is None


def test_the_checkpoint_estimate_counts_weights_and_adam_moments():
    import torch

    class L:
        policy = torch.nn.Linear(10, 10)  # 110 trained fp32 parameters
        critic = None

    assert checkpoint_bytes(L()) == 110 * (4 + 8) + 110 * 12 // 10 + 2**20
