"""The Trajectory record: lossless JSONL round trip and validation of its per-token fields."""

import math
import random

import pytest

from saorl.data.trajectory import Episode, Trajectory, TrajectoryError


def _random_traj(rng: random.Random, i: int) -> Trajectory:
    p, n = rng.randint(1, 5), rng.randint(1, 20)
    mask = [0] * p + [rng.randint(0, 1) for _ in range(n)]
    return Trajectory(
        token_ids=[rng.randint(0, 1023) for _ in mask], action_mask=mask,
        rollout_logprobs=[-rng.random() * 10 if m else 0.0 for m in mask],
        rewards=[rng.choice([0.0, 1.0, 0.1 + 0.2]) for _ in mask],  # 0.30000000000000004 on purpose
        versions=[rng.randint(0, 9) if m else -1 for m in mask], prompt_len=p, task_id=f"t{i}",
        truncated=bool(i % 2), metadata={"note": "ünïcode", "list": [1, 2]},
        episode=Episode(env="e", turns=2, success=i % 3 == 0, turn_rewards=[0.1 + 0.2],
                        turn_spans=[[p, p + 1]], rid=i, worker=i % 2, t_start=1.5 + i,
                        t_end=None if i % 2 else 2.25))


def test_json_round_trip_is_bit_exact(tmp_path):
    rng = random.Random(0)
    trajs = [_random_traj(rng, i) for i in range(50)]
    (tmp_path / "t.jsonl").write_text("".join(t.to_json() + "\n" for t in trajs))
    back = [Trajectory.from_json(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert back == trajs  # dataclass equality: every float identical, not approximately
    assert all(a.rollout_logprobs == b.rollout_logprobs for a, b in zip(trajs, back))


def test_derived_views():
    t = Trajectory([1, 2, 3, 4, 5], [0, 1, 0, 1, 1], [0.0, -1.0, 0.0, -2.0, -0.5], [0, 0, 0, 0, 1.0],
                   [-1, 3, -1, 4, 4], prompt_len=1)
    assert t.num_action_tokens == 3 and t.total_reward == 1.0
    assert t.action_versions == [3, 4, 4] and t.staleness(6) == 3


@pytest.mark.parametrize("change, match", [
    ({"action_mask": [0, 1]}, "action_mask has 2 entries"),
    ({"prompt_len": 9}, "prompt_len=9"),
    ({"action_mask": [1, 1, 0]}, "prompt token is marked as an action"),
    ({"action_mask": [0, 2, 0]}, "only 0 and 1"),
    ({"rollout_logprobs": [0.0, 0.5, 0.0]}, "rollout logprob 0.5"),
    ({"rollout_logprobs": [0.0, math.nan, 0.0]}, "rollout logprob nan"),
    ({"versions": [-1, -1, -1]}, "has no version"),
    ({"rewards": [0.0, math.inf, 0.0]}, "non-finite reward"),
])
def test_inconsistent_fields_are_rejected(change, match):
    base = dict(token_ids=[1, 2, 3], action_mask=[0, 1, 0], rollout_logprobs=[0.0, -1.0, 0.0],
                rewards=[0.0, 1.0, 0.0], versions=[-1, 0, -1], prompt_len=1, task_id="x")
    with pytest.raises(TrajectoryError, match=match):
        Trajectory(**(base | change))


def test_records_of_another_shape_are_rejected_with_the_reason():
    good = Trajectory([1, 2], [0, 1], [0.0, -1.0], [0.0, 1.0], [-1, 0], 1).to_json()
    with pytest.raises(TrajectoryError, match=r"missing trajectory fields: \['action_mask'"):
        Trajectory.from_json('{"token_ids": [1]}')
    with pytest.raises(TrajectoryError, match="unknown trajectory fields"):
        Trajectory.from_json(good[:-1] + ',"bogus": 1}')
    with pytest.raises(TrajectoryError, match="must be a JSON object, got list"):
        Trajectory.from_json("[1, 2]")
    with pytest.raises(TrajectoryError, match="unknown episode fields"):
        Trajectory.from_json(good[:-1] + ',"episode": {"turnz": 1}}')


def test_cut_short_counts_an_action_cut_at_its_token_limit_as_well_as_a_truncated_episode():
    from saorl.data.trajectory import Episode

    def traj(reasons, truncated=False):
        return Trajectory([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], [0.0, 0.0, 1.0], [-1, 0, 0], 1,
                          truncated=truncated, episode=Episode(finish_reasons=reasons))

    assert not traj(["stop"]).cut_short and not traj([]).cut_short
    assert traj(["length"]).cut_short  # one turn sampled to max_new_tokens, then the env ended it
    assert not traj(["length", "stop"]).cut_short  # an earlier turn was cut, the last one was not
    assert traj(["stop"], truncated=True).cut_short  # ended by the turn or token limit


def test_p90_of_the_action_lengths():
    from saorl.runtime.run import _p90

    assert _p90([7]) == 7.0
    assert _p90(list(range(1, 11))) == pytest.approx(9.1)  # numpy's default (linear) percentile
    assert _p90([10, 10, 10, 100]) == pytest.approx(73.0)
