"""How an OpenAI-API agent's calls join (saorl.agent.openai_record), on hand-made ids."""

from saorl.agent.openai_record import Call, CallLog
from saorl.data.trajectory import Episode, training_rows


def _call(prompt, sampled):
    return Call(list(prompt), list(sampled), [-0.5] * len(sampled), [2] * len(sampled), "stop")


def test_calls_join_where_the_prompt_extends_a_segment_and_branch_from_the_longest():
    log = CallLog()
    assert not log.add(_call([1, 2, 3], [10, 11]))               # a new segment: prompt, action
    assert log.add(_call([1, 2, 3, 10, 11, 4, 5], [12]))          # extends it: 4, 5 are observations
    assert not log.add(_call([1, 2, 9], [13]))                   # the history rewritten: a new segment
    assert log.add(_call([1, 2, 3, 10, 11, 4, 5, 12, 6], [14]))   # the first conversation goes on
    traj = log.trajectory("t", 2.0, Episode(env="openai_agent"))
    assert traj.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 14] and traj.prompt_len == 3
    assert traj.action_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1]
    assert traj.versions == [-1, -1, -1, 2, 2, -1, -1, 2, -1, 2]
    assert traj.rollout_logprobs[3:5] == [-0.5, -0.5] and traj.rollout_logprobs[5] == 0.0
    assert traj.rewards == [0.0] * 9 + [2.0]
    assert traj.episode.turn_spans == [[3, 5], [7, 8], [9, 10]] and traj.episode.turns == 4
    (seg,) = traj.segments
    assert seg.token_ids == [1, 2, 9, 13] and seg.action_mask == [0, 0, 0, 1]
    assert seg.rewards == [0, 0, 0, 2.0] and seg.prompt_len == 3
    assert traj.episode.env_metrics == {"segments_per_episode": 2.0, "calls_per_episode": 4.0}
    rows, gids = training_rows([traj], [5])
    assert [r.token_ids for r in rows] == [[1, 2, 9, 13], traj.token_ids] and gids == [5, 5]


def test_parallel_calls_of_one_conversation_each_take_the_longest_segment_they_extend():
    log = CallLog()
    log.add(_call([1, 2], [3]))
    log.add(_call([1, 2, 3, 4], [5]))        # joins
    log.add(_call([1, 2, 3, 4], [6]))        # the same prompt again (a retry, a branch): a new segment
    log.add(_call([1, 2, 3, 4, 6, 7], [8]))  # extends the branch, the longest that it extends
    assert [s.token_ids for s in log.segments] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7, 8]]
    assert log.segments[1].action_mask == [0, 0, 0, 0, 1, 0, 1]  # the branch's prompt holds no action


def test_a_group_baseline_with_openai_agent_is_refused_at_start_up():
    """An episode of k segments is k rows with its reward: a group's mean and std would count it k
    times, so grpo's group baseline is refused for openai_agent (docs/agents.md)."""
    import pytest
    from pydantic import ValidationError

    from saorl.config.schema import SaorlConfig

    env = {"type": "openai_agent", "options": {"agent": "m:f"}}
    for name in ("grpo", "grpo_dis"):
        with pytest.raises(ValidationError, match="once per segment"):
            SaorlConfig.model_validate({"env": env, "algo": {"name": name}, "trainer": {"batch_size": 8}})
    assert SaorlConfig.model_validate({"env": env, "algo": {"name": "sao"}}).algo.name == "sao"
    assert SaorlConfig.model_validate({"env": {"type": "math_tool"}, "algo": {"name": "grpo"},
                                       "trainer": {"batch_size": 8}}).algo.name == "grpo"
