"""run_episode: token exactness, masks, rewards, versions, limits, errors."""

from __future__ import annotations

import asyncio

import pytest
from agent_fakes import FakeEngine, ToyEnv

from saorl.agent import EpisodeError, PromptTooLongError, run_episode
from saorl.engines.base import EngineError, SamplingParams
from saorl.envs.base import Progress, Task

TASK = Task("t-7", {"q": 7})
SP = SamplingParams(max_new_tokens=64)


def enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


def odd_ids(tok, text):
    """One token per character: a non-canonical tokenization of ``text``."""
    ids = [i for ch in text for i in enc(tok, ch)]
    assert ids != enc(tok, text), "test needs a text whose canonical tokenization merges characters"
    assert tok.decode(ids) == text
    return ids


def play(engine, env, tok, **kw):
    kw.setdefault("sampling", SP)
    return asyncio.run(run_episode(engine, env, TASK, tok, **kw))


def test_multi_turn_trajectory_is_token_exact(tok):
    a1 = odd_ids(tok, "hello world</a>")          # re-tokenizing the text would merge these
    a2 = [*enc(tok, "answer 42"), tok.eos_token_id]  # ends on eos
    engine = FakeEngine([a1, a2])
    env = ToyEnv(done_after=2)
    traj = play(engine, env, tok)
    traj.validate()

    prompt_ids = enc(tok, "Q7:")
    obs1 = enc(tok, "<obs 1>\n")
    assert traj.token_ids == prompt_ids + a1 + obs1 + a2  # ids kept exactly as sampled
    assert traj.prompt_len == len(prompt_ids)
    # the env saw the decoded actions, eos stripped; the eos stays in the trajectory
    assert env.actions == ["hello world</a>", "answer 42"]
    assert traj.token_ids[-1] == tok.eos_token_id and traj.action_mask[-1] == 1
    text = tok.decode(traj.token_ids)
    assert text == "Q7:" + "hello world</a>" + "<obs 1>\n" + "answer 42" + tok.eos_token
    # the final observation is not tokenized; it is kept as text
    assert traj.episode.final_observation == "<obs 2>\n"

    # action_mask covers exactly the sampled tokens; logprobs and versions as returned
    pos = [t for t, m in enumerate(traj.action_mask) if m]
    a1_at = list(range(len(prompt_ids), len(prompt_ids) + len(a1)))
    a2_at = list(range(len(traj) - len(a2), len(traj)))
    assert pos == a1_at + a2_at
    for call, at in zip(engine.calls, (a1_at, a2_at)):
        assert [traj.token_ids[t] for t in at] == call.result.token_ids
        assert [traj.rollout_logprobs[t] for t in at] == call.result.logprobs
        assert [traj.versions[t] for t in at] == call.result.versions
    for t, m in enumerate(traj.action_mask):
        if not m:
            assert traj.rollout_logprobs[t] == 0.0 and traj.versions[t] == -1
    # each request's prompt is exactly the trajectory so far (no re-tokenization anywhere)
    assert engine.calls[0].prompt == prompt_ids
    assert engine.calls[1].prompt == prompt_ids + a1 + obs1
    assert traj.episode.turn_spans == [[a1_at[0], a1_at[-1] + 1], [a2_at[0], a2_at[-1] + 1]]


def test_request_params_carry_env_stop_strings_and_eos(tok):
    engine = FakeEngine([enc(tok, "x</a>")] * 2)
    play(engine, ToyEnv(), tok, sampling=SamplingParams(max_new_tokens=9, stop=("STOP",), temperature=0.7))
    p = engine.calls[0].params
    assert p.stop == ("STOP", "</a>") and p.stop_token_ids == (tok.eos_token_id,)
    assert p.temperature == 0.7 and p.max_new_tokens == 9


def test_rewards_land_on_last_action_token_of_each_turn(tok):
    acts = [enc(tok, "a b c</a>"), enc(tok, "dd</a>"), enc(tok, "e")]
    env = ToyEnv(rewards=[0.5, -1.0, 2.0], done_after=3)
    traj = play(FakeEngine(acts), env, tok)
    ends = [b - 1 for _, b in traj.episode.turn_spans]
    assert [traj.action_mask[t] for t in ends] == [1, 1, 1]
    expected = [0.0] * len(traj)
    for t, r in zip(ends, [0.5, -1.0, 2.0]):
        expected[t] = r
    assert traj.rewards == expected
    assert traj.episode.turn_rewards == [0.5, -1.0, 2.0]
    assert traj.episode.final_reward == 2.0 and traj.total_reward == pytest.approx(1.5)
    assert traj.episode.turns == 3 and traj.episode.success is False  # success only at turn 2
    assert not traj.truncated and traj.episode.truncation is None


def test_trajectory_spans_two_policy_versions(tok):
    engine = FakeEngine([enc(tok, "one</a>"), enc(tok, "two</a>")], versions_per_call=[3, 4])
    traj = play(engine, ToyEnv(done_after=2), tok)
    (s1, e1), (s2, e2) = traj.episode.turn_spans
    assert set(traj.versions[s1:e1]) == {3} and set(traj.versions[s2:e2]) == {4}
    assert traj.staleness(5) == 2 and sorted(set(traj.action_versions)) == [3, 4]


def test_turn_limit_truncates(tok):
    engine = FakeEngine(lambda p, sp, k: enc(tok, f"turn {k}</a>"))
    traj = play(engine, ToyEnv(done_after=None), tok)  # env.max_turns = 3
    assert traj.truncated and traj.episode.truncation == "turns" and traj.episode.turns == 3
    traj = play(FakeEngine(engine.script), ToyEnv(done_after=None), tok, max_turns=1)
    assert traj.episode.turns == 1 and traj.episode.truncation == "turns"
    # ending on done at the very last allowed turn is not a truncation
    traj = play(FakeEngine(engine.script), ToyEnv(done_after=2), tok, max_turns=2)
    assert not traj.truncated and traj.episode.success is True


@pytest.mark.parametrize("budget", [6, 9, 12, 17, 23, 30, 41])
def test_token_budget_is_never_exceeded(tok, budget):
    engine = FakeEngine(lambda p, sp, k: enc(tok, "some longer action text</a>"))
    env = ToyEnv(done_after=None, obs="<observation {k}>\n")
    traj = play(engine, env, tok, max_turns=10, max_total_tokens=budget)
    traj.validate()
    assert len(traj) <= budget
    assert traj.truncated and traj.episode.truncation == "tokens"
    for call in engine.calls:  # each request asked for no more than the tokens left
        assert len(call.prompt) + call.params.max_new_tokens <= budget
    # truncated actions are still stepped and their reward placed
    assert len(env.actions) == traj.episode.turns == len(engine.calls)


def test_observation_that_does_not_fit_ends_the_episode(tok):
    a = enc(tok, "go</a>")
    long_obs = "x" * 200
    env = ToyEnv(done_after=None, obs=long_obs)
    traj = play(FakeEngine([a] * 5), env, tok, max_total_tokens=60)
    assert traj.token_ids == enc(tok, "Q7:") + a  # the observation is dropped, never cut
    assert traj.episode.truncation == "tokens" and traj.episode.final_observation == long_obs


def test_prompt_too_long_is_a_clear_error(tok):
    with pytest.raises(PromptTooLongError, match=r"t-7.*max_total_tokens=3"):
        play(FakeEngine([[5]]), ToyEnv(), tok, max_total_tokens=3)


def test_engine_error_names_the_task(tok):
    with pytest.raises(EngineError, match=r"task 't-7'.*server went away"):
        play(FakeEngine([enc(tok, "a</a>")] * 3, fail_on_call=1), ToyEnv(), tok)


@pytest.mark.parametrize("bad, msg", [
    (dict(finish_reason="abort"), "aborted"),
    (dict(script=[[]]), "no tokens"),
])
def test_bad_generations_are_engine_errors(tok, bad, msg):
    kw = dict(script=[enc(tok, "a")]) | bad
    with pytest.raises(EngineError, match=msg):
        play(FakeEngine(**kw), ToyEnv(), tok)


@pytest.mark.parametrize("where", ["reset", "step"])
def test_env_exceptions_surface_as_episode_errors(tok, where):
    with pytest.raises(EpisodeError, match=rf"env 'toy' raised in {where} on task 't-7'") as ei:
        play(FakeEngine([enc(tok, "a")]), ToyEnv(fail_in=where), tok)
    assert isinstance(ei.value.__cause__, (KeyError, ZeroDivisionError))


def test_progress_reaches_reset_and_timings_are_recorded(tok):
    env = ToyEnv(step_sleep=0.01)
    traj = play(FakeEngine([enc(tok, "a</a>")] * 2), env, tok, progress=Progress(trainer_step=5))
    assert env.progress == Progress(trainer_step=5)
    ep = traj.episode
    assert ep.env == "toy" and ep.finish_reasons == ["stop", "stop"]
    assert ep.env_seconds >= 0.02 and ep.gen_seconds >= 0.0


def test_the_turn_limit_is_read_after_reset(tok):
    """An env may set its turn limit per task in reset (a mix sets its part's)."""

    class PerTaskLimit(ToyEnv):
        def reset(self, task, progress=None):
            self.max_turns = 2
            return super().reset(task, progress)

    engine = FakeEngine(lambda p, sp, k: enc(tok, f"turn {k}</a>"))
    traj = play(engine, PerTaskLimit(done_after=None), tok)  # the class says 3
    assert traj.episode.turns == 2 and traj.episode.truncation == "turns"


def test_bad_limits_rejected(tok):
    with pytest.raises(ValueError, match="max_turns"):
        play(FakeEngine([[5]]), ToyEnv(), tok, max_turns=0)


def test_seeds_are_derived_per_task_sample_and_turn(tok):
    def seeds(task, index, seed=11):
        engine = FakeEngine([enc(tok, "a</a>")] * 2)
        asyncio.run(run_episode(engine, ToyEnv(), task, tok, sampling=SamplingParams(seed=seed),
                                sample_index=index))
        return [c.params.seed for c in engine.calls]

    s = seeds(TASK, 0)
    assert s == seeds(TASK, 0) and len(set(s)) == 2  # reproducible; turns differ
    assert not set(s) & set(seeds(TASK, 1)) and not set(s) & set(seeds(Task("other", {"q": 7}), 0))
    assert seeds(TASK, 0, seed=None) == [None, None]


def test_empty_prompt_is_an_env_error(tok):
    class Empty(ToyEnv):
        def reset(self, task, progress=None):
            return ""

    with pytest.raises(EpisodeError, match="empty prompt"):
        play(FakeEngine([[5]]), Empty(), tok)


def test_env_returning_the_wrong_type_is_an_episode_error(tok):
    class Sloppy(ToyEnv):
        def step(self, action):
            return ("obs", 1.0, True)

    with pytest.raises(EpisodeError, match="step on task 't-7' returned tuple, expected StepResult"):
        play(FakeEngine([[5]]), Sloppy(), tok)


def _with_metrics(metrics):
    class Measured(ToyEnv):
        def step(self, action):
            out = super().step(action)
            if out.done:
                out.info["metrics"] = metrics
            return out

    return Measured()


def test_env_metrics_reach_the_episode_and_survive_json(tok):
    from saorl.data.trajectory import Trajectory, env_metric_means

    traj = play(FakeEngine([enc(tok, "a</a>")] * 2), _with_metrics({"hit": True, "dist": 3}), tok)
    assert traj.episode.env_metrics == {"hit": 1.0, "dist": 3.0}
    assert Trajectory.from_json(traj.to_json()).episode.env_metrics == {"hit": 1.0, "dist": 3.0}
    plain = play(FakeEngine([enc(tok, "a</a>")] * 2), ToyEnv(), tok)
    assert plain.episode.env_metrics == {}
    other = play(FakeEngine([enc(tok, "a</a>")] * 2), _with_metrics({"hit": 0.0}), tok)
    # means over the trajectories that report each key; keys no one reports are absent
    assert env_metric_means([traj, plain, other]) == {"env/dist": 3.0, "env/hit": 0.5}
    assert env_metric_means([plain], "eval/env/") == {}
    from saorl.stages.evaluate import eval_metrics

    m = eval_metrics([traj, plain, other])
    assert (m["eval/env/hit"], m["eval/env/dist"]) == (0.5, 3.0)


@pytest.mark.parametrize("metrics", [[1.0], {"x": float("nan")}, {"x": "high"}, {3: 1.0}, {"x": None}])
def test_bad_env_metrics_are_episode_errors(tok, metrics):
    with pytest.raises(EpisodeError, match=r"env 'toy' on task 't-7': info\['metrics'\]"):
        play(FakeEngine([enc(tok, "a</a>")] * 2), _with_metrics(metrics), tok)
