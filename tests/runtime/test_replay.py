"""``saorl replay``: the learner re-run on a run's recorded batches from a checkpoint.

One short asynchronous in-process run (its batches depend on timing, which the replay must not:
it reads them from trained.jsonl and the journal), then replays of it: with the run's own
settings every logged loss and KL is reproduced; with another policy learning rate the first
replayed step is still the run's (same weights before it) and the next ones are not.
"""

import json

import pytest
from runtime_helpers import BASE

from saorl.cli import main
from saorl.config import load_config
from saorl.training import train

KEYS = ("policy/loss", "mismatch/kl", "policy/entropy", "critic/value_loss", "critic/value_loss_after",
        "advantage/std", "policy/grad_norm")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    cfg = load_config(None, [*BASE, "runtime.backend=inprocess", "trainer.steps=6", "run.checkpoint_every=2",
                             "run.keep_checkpoints=5"])
    run_dir, _ = train(cfg, tmp_path_factory.mktemp("replay") / "run")
    return run_dir


def _replay(run_dir, out, *args):
    assert main(["replay", str(run_dir), "--out", str(out), *args]) == 0
    return [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]


def test_an_unchanged_replay_reproduces_the_logged_losses_and_kl(run_dir, tmp_path, capsys):
    rows = _replay(run_dir, tmp_path / "same", "--from-step", "2", "--probe", "<tool>", "3")
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    for r in rows:
        for k in KEYS:
            assert r["replay"][k] == pytest.approx(r["original"][k], rel=1e-6, abs=1e-9), (r["step"], k)
        assert r["replay"]["policy/version"] == r["original"]["policy/version"]
        assert 0.0 < r["probes"][0] <= 1.0
    out = capsys.readouterr().out
    assert "replaying" in out and "policy/loss run" in out  # the side-by-side table
    table = [line for line in out.splitlines() if line.lstrip().startswith(("step", "3 ", "4 ", "5 ", "6 "))]
    assert len(table) == 5 and len({len(line) for line in table}) == 1, table  # columns aligned


def test_a_changed_learning_rate_departs_after_the_first_replayed_step(run_dir, tmp_path):
    rows = _replay(run_dir, tmp_path / "lr", "trainer.policy_lr=0.05", "--steps", "3")
    assert [r["step"] for r in rows] == [3, 4, 5]  # from the oldest kept checkpoint, step 2
    first, later = rows[0], rows[1:]
    assert first["replay"]["policy/loss"] == pytest.approx(first["original"]["policy/loss"], rel=1e-6)
    assert first["replay"]["policy/lr"] == 0.05 != first["original"]["policy/lr"]
    assert any(abs(r["replay"]["mismatch/kl"] - r["original"]["mismatch/kl"]) > 1e-4 for r in later)


def test_a_replay_from_a_checkpoint_that_is_not_kept_is_one_paragraph(run_dir, tmp_path, capsys):
    assert main(["replay", str(run_dir), "--from-step", "3", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 3" in err and "2, 4, 6" in err and "Traceback" not in err
    assert main(["replay", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_a_replay_cannot_regroup_the_batches(run_dir, tmp_path, capsys):
    argv = ["replay", str(run_dir), "algo.name=grpo", "algo.group_size=4", "--out", str(tmp_path / "g")]
    assert main(argv) == 2
    assert "cannot regroup them into 4" in capsys.readouterr().err


def test_resume_markers_give_the_versions_a_resumed_run_continued_with():
    from saorl.runtime.replay import _resume_versions

    rows = [{"step": 1}, {"step": 2}, {"resume": {"from_step": 2, "version": 5}}, {"step": 3},
            {"step": 4}, {"resume": {"from_step": 3, "version": 9}}, {"step": 4}]
    assert _resume_versions(rows) == {2: 5, 3: 9}
    rows.append({"resume": {"from_step": 2, "version": 11}})  # back before both: they no longer stand
    assert _resume_versions(rows) == {2: 11}
