"""A resume's versions and staleness: the journalled trajectories of a run killed before its first
checkpoint keep the staleness they had, though the resumed learner numbers its versions above those
published before the kill."""

from __future__ import annotations

from types import SimpleNamespace

from saorl.data.trajectory import Trajectory
from saorl.run_paths import RunPaths
from saorl.runtime.journal import Journal
from saorl.runtime.resume import Lineage, restore


def _traj(rid: int, version: int) -> Trajectory:
    t = Trajectory(token_ids=[5, 6, 7], action_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.5, -1.25],
                   rewards=[0.0, 0.0, 1.0], versions=[-1, version, version], prompt_len=1, task_id=str(rid))
    t.episode.rid = rid
    return t


class _Recorder:
    def __init__(self):
        self.lines, self.markers = [], []

    def message(self, text):
        self.lines.append(text)

    def resumed(self, info):
        self.markers.append(info)


def test_a_resume_without_checkpoint_counts_staleness_in_the_run_s_own_updates(tmp_path):
    journal = Journal(tmp_path / "journal")
    journal.append_many([_traj(rid, version=rid // 2) for rid in range(8)])  # sampled at versions 0-3
    journal.close()
    learner, recorder = SimpleNamespace(version=0), _Recorder()
    weights = SimpleNamespace(published_version=lambda: 9)  # 9 versions published before the kill
    start = restore(RunPaths(tmp_path), learner, Journal(tmp_path / "journal"), recorder, weights,
                    fallback=True, restart=False)
    assert learner.version == 10 and recorder.markers[0]["version"] == 10 and len(start.pending) == 8
    assert start.lineage == Lineage(resumed_version=10, skipped=10)
    first, last = start.pending[0], start.pending[-1]  # versions 0 and 3
    # the redone step 1 trains at version 10 what was sampled at version 0: fresh, as it was then
    assert (first.staleness(10), start.lineage.staleness(first, 10)) == (10, 0)
    assert start.lineage.staleness(first, 12) == 2
    assert start.lineage.staleness(last, 11) == 0  # sampled by discarded weights past this step: 0
    new = _traj(99, version=11)  # sampled after the resume: counted as it is
    assert start.lineage.staleness(new, 13) == new.staleness(13) == 2


def test_no_resume_no_change():
    t = _traj(0, version=3)
    assert Lineage().staleness(t, 7) == t.staleness(7) == 4
