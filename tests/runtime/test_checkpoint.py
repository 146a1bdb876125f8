"""Checkpoints on a real tiny learner: what a resume checks, where it falls back, when it stops.

Two checkpoints (steps 2 and 4) with a journal between them; each test damages one thing the
way a disk, a crash or a user can, and asserts what :func:`resume_checkpoint` does: the intact
one, the previous one (with the damaged directory moved aside), or a one-paragraph
:class:`CorruptionError` naming the file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from saorl.algo.registry import get_preset
from saorl.data.trajectory import Trajectory
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny
from saorl.runtime.checkpoint import (
    check_restart,
    checkpoint_dirs,
    load_checkpoint,
    oldest_journal_segment,
    restart_problem,
    resume_checkpoint,
    save_checkpoint,
)
from saorl.runtime.journal import Journal
from saorl.runtime.learner.single import Learner, OptimConfig
from saorl.runtime.rundir import CorruptionError


def _traj(tid: str, rid: int = -1) -> Trajectory:
    t = Trajectory(token_ids=[5, 6, 7], action_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.5, -1.25],
                   rewards=[0.0, 0.0, 1.0], versions=[-1, 3, 4], prompt_len=1, task_id=tid)
    t.episode.rid = rid
    return t


def _learner(seed=0) -> Learner:
    policy = build_tiny("tiny-dense", seed=seed)
    lrn = Learner(policy, Critic.from_policy(policy), get_preset("sao"), OptimConfig(), pad_id=1)
    for params, opt in ((lrn.policy_params, lrn.policy_opt), (lrn.critic_params, lrn.critic_opt)):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt.step()  # optimizer state to save
        opt.zero_grad()
    return lrn


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """RUN/checkpoints with step-2 and step-4, RUN/journal from segment 0; the learner at step 4."""
    tmp_path = tmp_path_factory.mktemp("run")
    root, journal = tmp_path / "checkpoints", Journal(tmp_path / "journal")
    lrn = _learner()
    journal.append_many([_traj("a", 0), _traj("b", 1)])
    save_checkpoint(root, 2, lrn, {"finished": [[0, 2]], "journal_segment": journal.rotate()}, [])
    with torch.no_grad():
        for p in lrn.policy.parameters():
            p.add_(0.5)
    lrn.version = 4
    journal.append_many([_traj("c", 2), _traj("d", 3)])
    save_checkpoint(root, 4, lrn, {"finished": [[0, 4]], "journal_segment": journal.rotate()},
                    [_traj("d", 3)])
    journal.prune_before(oldest_journal_segment(root))
    journal.close()
    return tmp_path, lrn


@pytest.fixture
def run(template, tmp_path):
    """A fresh copy of the template run for each test (each damages it)."""
    shutil.copytree(template[0], tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints", template[1]


def _resume(tmp_path, fallback=True):
    logs = []
    found = resume_checkpoint(tmp_path / "checkpoints", Journal(tmp_path / "journal"), fallback=fallback,
                              log=logs.append)
    return found, logs


def test_an_intact_checkpoint_restores_exactly_and_keeps_the_journal_of_the_older_one(run):
    tmp_path, root, lrn = run
    assert [d.name for d in checkpoint_dirs(root)] == ["step-00000002", "step-00000004"]
    # the journal is kept back to the oldest kept checkpoint (segment 1), not only the newest (2)
    assert oldest_journal_segment(root) == 1
    assert sorted(p.name for p in (tmp_path / "journal").glob("seg-*"))[0] == "seg-00000001.jsonl"
    (ckpt, manifest), logs = _resume(tmp_path)
    assert ckpt.name == "step-00000004" and manifest["step"] == 4 and not logs
    policy = build_tiny("tiny-dense", seed=1)
    fresh = Learner(policy, Critic.from_policy(policy), get_preset("sao"), OptimConfig(), pad_id=1)
    pending = load_checkpoint(ckpt, fresh, manifest)
    assert [t.episode.rid for t in pending] == [3] and pending[0] == _traj("d", 3)
    assert fresh.version == 4
    for a, b in zip(lrn.policy.state_dict().values(), fresh.policy.state_dict().values()):
        assert torch.equal(a, b)
    saved, loaded = lrn.policy_opt.state_dict()["state"], fresh.policy_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"])
                                                  for k in saved)


def _flip_byte(path, offset_from_end=100):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01  # one bit of the tensor data: the file still parses
    path.write_bytes(bytes(data))


DAMAGE = {
    "manifest deleted": lambda d: (d / "manifest.json").unlink(),
    "manifest cut in half": lambda d: (d / "manifest.json").write_bytes(
        (d / "manifest.json").read_bytes()[:200]),
    "manifest value changed": lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"step": 4', '"step": 5')),
    "policy tensor bit flipped": lambda d: _flip_byte(d / "policy.safetensors"),
    "optimizer file truncated": lambda d: (d / "optim.safetensors").write_bytes(
        (d / "optim.safetensors").read_bytes()[:1000]),
    "pending file edited": lambda d: (d / "pending.jsonl").write_text(""),
    "critic file deleted": lambda d: (d / "critic.safetensors").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_falls_back_to_the_previous_checkpoint(run, damage):
    tmp_path, root, _ = run
    bad = root / "step-00000004"
    DAMAGE[damage](bad)
    (ckpt, manifest), logs = _resume(tmp_path)
    assert ckpt.name == "step-00000002" and manifest["step"] == 2
    assert len(logs) == 1 and "step-00000004" in logs[0] and "step-00000002" in logs[0]
    assert not bad.exists() and (root / "damaged-step-00000004").is_dir()  # kept, out of the way
    assert (root / "latest").read_text() == "step-00000002"
    # the older checkpoint's journal is there: resuming from it loses nothing
    journalled = Journal(tmp_path / "journal").read_from(manifest["journal_segment"])
    assert [t.episode.rid for t in journalled] == [2, 3]


@pytest.mark.parametrize("damage", ["manifest deleted", "policy tensor bit flipped"])
def test_without_fallback_it_stops_naming_the_file_and_the_intact_checkpoint(run, damage):
    tmp_path, root, _ = run
    DAMAGE[damage](root / "step-00000004")
    with pytest.raises(CorruptionError) as e:
        _resume(tmp_path, fallback=False)
    msg = str(e.value)
    name = "manifest.json" if "manifest" in damage else "policy.safetensors"
    assert str(root / "step-00000004" / name) in msg and "step-00000002" in msg
    assert "\n" not in msg and (root / "step-00000004").is_dir()  # nothing moved


def test_latest_deleted_or_dangling_uses_the_newest_intact_directory(run):
    tmp_path, root, _ = run
    (root / "latest").unlink()
    (ckpt, _), logs = _resume(tmp_path)
    assert ckpt.name == "step-00000004" and "latest is missing" in logs[0]
    (root / "latest").write_text("step-00000099")
    (ckpt, _), logs = _resume(tmp_path)
    assert ckpt.name == "step-00000004" and "step-00000099" in logs[0]
    assert (root / "latest").read_text() == "step-00000004"


def test_no_intact_checkpoint_left_stops_and_never_restarts_from_zero(run):
    tmp_path, root, _ = run
    _flip_byte(root / "step-00000004" / "policy.safetensors")
    (root / "step-00000002" / "manifest.json").unlink()
    with pytest.raises(CorruptionError) as e:
        _resume(tmp_path)
    msg = str(e.value)
    assert "no intact earlier checkpoint" in msg and "step 0" in msg
    assert str(root / "step-00000004" / "policy.safetensors") in msg
    assert str(root / "step-00000002" / "manifest.json") in msg


def test_a_missing_journal_segment_makes_a_checkpoint_unusable(run):
    tmp_path, _, _ = run
    (tmp_path / "journal" / "seg-00000002.jsonl").unlink()  # what step-4 continues from
    with pytest.raises(CorruptionError, match=r"seg-00000002\.jsonl, which checkpoint step-00000004"):
        _resume(tmp_path, fallback=False)
    with pytest.raises(CorruptionError, match="no intact earlier checkpoint"):
        _resume(tmp_path)  # step-2 needs segments 1, 2, ... as well: no way around the gap


def test_no_checkpoint_resumes_from_zero_only_when_none_was_ever_written(tmp_path):
    journal = Journal(tmp_path / "journal")
    journal.append(_traj("a", 0))
    journal.close()
    assert _resume(tmp_path) == (None, [])  # a crash before the first checkpoint
    journal.rotate()
    journal.close()
    (tmp_path / "journal" / "seg-00000000.jsonl").unlink()  # pruned: checkpoints existed
    with pytest.raises(CorruptionError, match="holds no checkpoint, but the journal starts at seg-00000001"):
        _resume(tmp_path)


def _record(run_dir, steps: int, per_step: int = 2) -> None:
    """trained.jsonl and metrics.jsonl of ``steps`` trained steps, as a run writes them."""
    with open(run_dir / "trained.jsonl", "a") as t, open(run_dir / "metrics.jsonl", "a") as m:
        for s in range(1, steps + 1):
            t.write(json.dumps({"step": s, "rids": list(range((s - 1) * per_step, s * per_step))}) + "\n")
            m.write(json.dumps({"step": s, "reward/mean": 0.5}) + "\n")


def test_no_checkpoint_and_no_journal_but_trained_steps_on_record_is_never_a_silent_restart(tmp_path):
    """checkpoints/ and journal/ deleted after 13 steps: the record (trained.jsonl, metrics.jsonl,
    weights/) says so, and the resume stops naming it, unless restart is asked for."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
    _record(tmp_path, 13)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "v00000013.safetensors").write_bytes(b"x")
    with pytest.raises(CorruptionError) as e:
        check_restart(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot resume: ")
    for text in ("trained.jsonl records 13 trained steps (the last, step 13) on 26 rollouts",
                 "metrics.jsonl has 13 step rows", "weights/ holds version 13",
                 "journal holds none of the 26 rollouts trained.jsonl records as trained",
                 f"saorl train --resume {tmp_path} --restart"):
        assert text in msg, msg
    check_restart(tmp_path, restart=True)  # asked for: no refusal
    with pytest.raises(CorruptionError, match="silently discarding"):
        resume_checkpoint(tmp_path / "checkpoints", Journal(tmp_path / "journal"), fallback=True, log=print)
    assert resume_checkpoint(tmp_path / "checkpoints", Journal(tmp_path / "journal"), fallback=True,
                             log=print, restart=True) is None


@pytest.mark.parametrize("evidence", ["metrics", "weights"])
def test_other_evidence_of_training_with_an_empty_journal_stops_the_resume(tmp_path, evidence):
    if evidence == "metrics":  # trained.jsonl deleted too
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    else:
        (tmp_path / "weights").mkdir()
        (tmp_path / "weights" / "v00000000.safetensors").write_bytes(b"x")  # published before step 1
        assert restart_problem(tmp_path, Journal(tmp_path / "journal")) is None
        (tmp_path / "weights" / "v00000003").mkdir()  # a sharded publication: a directory
    assert "no rollout" in restart_problem(tmp_path, Journal(tmp_path / "journal"))


def test_a_crash_before_the_first_checkpoint_still_resumes_from_zero_from_the_journal(tmp_path):
    """The journal holds every rollout trained.jsonl records: the steps are redone from it."""
    journal = Journal(tmp_path / "journal")
    journal.append_many([_traj(str(i), i) for i in range(7)])  # 3 steps trained, one rollout pending
    _record(tmp_path, 3)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "v00000004.safetensors").write_bytes(b"x")  # killed after publishing step 4
    check_restart(tmp_path)
    assert _resume(tmp_path) == (None, [])
    # a resume from step 0 marks the version it published at: later publications are not evidence
    with open(tmp_path / "trained.jsonl", "a") as f:
        f.write(json.dumps({"resume": {"from_step": 0, "checkpoint": None, "version": 5}}) + "\n")
    journal.close()
    for seg in (tmp_path / "journal").iterdir():
        seg.unlink()
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "weights" / "v00000005.safetensors").write_bytes(b"x")
    check_restart(tmp_path)  # nothing trained since that resume: nothing to lose
    _record(tmp_path, 1)  # one step after it, whose rollouts the journal no longer has
    with pytest.raises(CorruptionError, match="records 1 trained steps"):
        check_restart(tmp_path)


def test_the_manifest_lists_a_hash_for_every_file(run):
    _, root, _ = run
    manifest = json.loads((root / "step-00000004" / "manifest.json").read_text())
    files = {p.name for p in (root / "step-00000004").iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files == {"policy.safetensors", "critic.safetensors",
                                                "optim.safetensors", "rng.safetensors", "pending.jsonl"}
    assert all(len(h) == 64 for h in manifest["files"].values()) and len(manifest["checksum"]) == 64
