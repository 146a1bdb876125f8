"""The transport seam: a finished rollout is its trajectory, named by its episode's rollout id."""

import pickle

from saorl.data.trajectory import Episode, Trajectory
from saorl.runtime.backends.local import collect
from saorl.runtime.backends.messages import EngineStats, PollResult, RolloutFailed, RolloutFinished


def _traj(rid: int, tid: str = "t") -> Trajectory:
    return Trajectory(token_ids=[5, 6, 7], action_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.5, -1.25],
                      rewards=[0.0, 0.0, 1.0], versions=[-1, 3, 3], prompt_len=1, task_id=tid,
                      episode=Episode(rid=rid, worker=1))


def test_a_finished_rollout_is_named_by_its_episode():
    msg = RolloutFinished(1, _traj(7))
    assert msg.rid == 7 and msg.trajectory.episode.rid == 7
    # what the process and Ray backends carry: pickled and back, the same message
    back = pickle.loads(pickle.dumps(msg))
    assert back == msg and back.rid == 7


def test_collect_gathers_trajectories_and_frees_their_slots():
    assigned = [set(), {3, 7, 9}]
    stats: dict[int, dict] = {}
    out = PollResult()
    first, second = _traj(7, "a"), _traj(3, "b")
    for msg in (RolloutFinished(1, first), RolloutFailed(1, 9, "boom"), RolloutFinished(1, second),
                EngineStats(1, {"decode_steps": 4.0})):
        collect(msg, out, assigned, stats)
    assert out.finished == [first, second]  # arrival order; each names its rollout itself
    assert [t.episode.rid for t in out.finished] == [7, 3]
    assert out.lost == [9] and out.errors == ["rollout 9 on worker 1 failed: boom"]
    assert assigned == [set(), set()] and stats == {1: {"decode_steps": 4.0}}
