"""Run figures and the timeline from fabricated run directories (hand-computed values)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from saorl.bench.runs import RolloutRecorder, analyse, percentile, slot_busy_seconds
from saorl.bench.timeline import assign_lanes, load_timeline, plot_timelines
from saorl.data.trajectory import Episode

TRAINED = [
    {"step": 1, "rids": [0, 1], "task_ids": ["a", "b"], "versions": [[0], [0]], "action_tokens": [10, 20],
     "workers": [0, 0], "rollout_start": [100.0, 100.0], "rollout_end": [101.0, 102.0],
     "train_start": 102.0, "train_end": 103.0},
    {"step": 2, "rids": [2, 3], "task_ids": ["c", "d"], "versions": [[0], [0, 1]], "action_tokens": [30, 40],
     "workers": [0, 0], "rollout_start": [101.0, 102.0], "rollout_end": [103.0, 104.0],
     "train_start": 104.0, "train_end": 106.0},
]
ROLLOUTS = [{"rid": i, "worker": 0, "t_start": s, "t_end": e, "tokens": n} for i, (s, e, n) in
            enumerate([(100.0, 101.0, 10), (100.0, 102.0, 20), (101.0, 103.0, 30), (102.0, 104.0, 40)])]
ROLLOUTS.append({"rid": 4, "t_submit": 104.0, "unfinished": True})


def _write(d: Path, name: str, rows: list[dict]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    _write(tmp_path, "trained.jsonl", TRAINED)
    _write(tmp_path, "metrics.jsonl", [{"step": 1, "time/wait_s": 2.0, "rollout/slot_util": 0.9},
                                       {"step": 2, "time/wait_s": 0.5, "rollout/slot_util": 0.8}])
    _write(tmp_path, "rollouts.jsonl", ROLLOUTS)
    return tmp_path


def test_analyse_hand_computed(run_dir: Path):
    s = analyse(run_dir, slots=2)
    assert s.window_s == pytest.approx(6.0)  # first rollout start 100 → last train end 106
    assert (s.steps, s.trained_tokens, s.trained_trajectories) == (2, 100, 4)
    assert s.tokens_per_s == pytest.approx(100 / 6) and s.trajectories_per_s == pytest.approx(4 / 6)
    assert s.trainer_idle_frac == pytest.approx(0.5 / 4)  # step 2's wait over [102, 106]
    # in flight: 2,2,2,1 over [100,104], then the unfinished one over [104,106] → 9 slot-seconds
    assert s.slot_util == pytest.approx(9 / 12)
    assert s.engine_step_util == pytest.approx(0.8)
    stale = (s.staleness_mean, s.staleness_p50, s.staleness_p90, s.staleness_max)
    assert stale == pytest.approx((0.5, 0.5, 1, 1))


def test_analyse_without_metrics_uses_training_gaps(run_dir: Path):
    (run_dir / "metrics.jsonl").unlink()
    assert analyse(run_dir, slots=2).trainer_idle_frac == pytest.approx(1.0 / 4)


def test_analyse_without_rollouts_uses_trained_intervals(run_dir: Path):
    (run_dir / "rollouts.jsonl").unlink()
    assert analyse(run_dir, slots=2).slot_util == pytest.approx(7 / 12)


def test_analyse_empty_run_is_an_error(tmp_path: Path):
    with pytest.raises(ValueError, match="budget"):
        analyse(tmp_path, slots=2)


def test_slot_busy_seconds_caps_at_slots_and_clips_to_window():
    rows = ROLLOUTS[:4]
    assert slot_busy_seconds(rows, 100, 104, slots=1) == pytest.approx(4.0)
    assert slot_busy_seconds(rows, 100, 104, slots=8) == pytest.approx(1 + 2 + 2 + 2)
    assert slot_busy_seconds(rows, 101.5, 102.5, slots=8) == pytest.approx(0.5 + 1 + 0.5)


def test_percentile_matches_numpy():
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_recorder_writes_finished_and_unfinished(tmp_path: Path):
    class T:
        def __init__(self) -> None:
            self.episode = Episode(rid=0, worker=1, t_start=5.0, t_end=7.0)
            self.num_action_tokens = 12

    rec = RolloutRecorder(tmp_path / "r.jsonl")
    rec.rollout_dispatched(0, 1.0)
    rec.rollout_dispatched(1, 2.0)
    rec.rollouts_finished([T()])
    rec.run_finished()
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rows[0] == {"rid": 0, "worker": 1, "t_start": 5.0, "t_end": 7.0, "tokens": 12}
    assert rows[1]["rid"] == 1 and rows[1]["unfinished"] is True


def test_assign_lanes_reuses_the_lowest_free_lane():
    assert assign_lanes([(0, 2), (1, 3), (2, 4), (0, 1)]) == [1, 0, 1, 0]
    lanes = assign_lanes([(0, 10)] * 3)
    assert sorted(lanes) == [0, 1, 2]


def test_timeline_from_trained_jsonl_alone(tmp_path: Path):
    _write(tmp_path, "trained.jsonl", TRAINED)
    tl = load_timeline(tmp_path)
    assert tl.t0 == 100.0 and tl.end == pytest.approx(6.0)
    assert tl.steps == [(2.0, 3.0), (4.0, 6.0)]
    assert len(tl.bars) == 4 and len(tl.lane_workers) == 2  # at most two rollouts overlap
    for lane, s, e, _ in tl.bars:  # no two bars overlap on one lane
        others = [(s2, e2) for lane2, s2, e2, _ in tl.bars if lane2 == lane and (s2, e2) != (s, e)]
        assert all(not (s < e2 and s2 < e) for s2, e2 in others)
    png = plot_timelines([("sync", tl), ("async", tl)], tmp_path / "img" / "t.png", slots=1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_timeline_with_rollouts_counts_unfinished(run_dir: Path):
    tl = load_timeline(run_dir)
    assert len(tl.bars) == 5
    assert any(e == pytest.approx(6.0) for _, s, e, n in tl.bars if s == pytest.approx(4.0))
