"""ScriptedEngine, demonstration trajectories, and render_trajectory."""

from __future__ import annotations

import asyncio
import random

import pytest
from agent_fakes import FakeEngine, ToyEnv

from saorl.agent import ScriptedEngine, demonstration_trajectory, render_trajectory, run_episode
from saorl.data.trajectory import Trajectory
from saorl.engines.base import EngineError, InferenceEngine, SamplingParams
from saorl.envs.base import Task

TASK = Task("d-3", {"q": 3})


def enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


def test_scripted_engine_is_an_inference_engine(tok):
    eng = ScriptedEngine(tok, ["a</a>", "b"], version=2)
    assert isinstance(eng, InferenceEngine)
    sp = SamplingParams(stop=("</a>",), max_new_tokens=50)
    r1, r2 = eng.generate([[5], [6]], sp)
    assert r1.token_ids == enc(tok, "a</a>") and r1.stop_reason == "</a>" and r1.finish_reason == "stop"
    assert r2.token_ids == [*enc(tok, "b"), tok.eos_token_id] and r2.stop_reason == tok.eos_token_id
    assert set(r1.versions) == {2} and set(r1.logprobs) == {0.0}
    eng.update_weights({}, 7)
    assert eng.version == 7 and eng.remaining == 0
    with pytest.raises(EngineError, match="ran out"):
        asyncio.run(eng.agenerate([1], sp))
    cut = ScriptedEngine(tok, ["a long action text"]).generate([[1]], SamplingParams(max_new_tokens=2))[0]
    assert cut.token_ids == enc(tok, "a long action text")[:2] and cut.finish_reason == "length"


def test_demonstration_trajectory_masks_exactly_the_demo_text(tok):
    env = ToyEnv(done_after=2, rewards=[0.0, 1.0])
    traj = asyncio.run(demonstration_trajectory(env, TASK, tok, random.Random(0), version=5))
    traj.validate()
    demo = ToyEnv().demonstration(TASK, random.Random(0))
    assert env.actions == demo  # the env was stepped with the demo text, eos stripped
    act = [t for t, m in zip(traj.token_ids, traj.action_mask) if m]
    # first action ends on the stop string (no eos); the last one gets an eos to end the turn
    assert act == [*enc(tok, demo[0]), *enc(tok, demo[1]), tok.eos_token_id]
    assert all(lp == 0.0 for lp in traj.rollout_logprobs)
    assert {v for v, m in zip(traj.versions, traj.action_mask) if m} == {5}
    assert tok.decode(traj.token_ids) == "Q3:" + demo[0] + "<obs 1>\n" + demo[1] + tok.eos_token
    assert traj.metadata["demonstration"] and traj.episode.success and traj.total_reward == 1.0
    assert not traj.truncated


def test_demonstration_that_does_not_finish_is_truncated(tok):
    traj = asyncio.run(demonstration_trajectory(ToyEnv(done_after=None), TASK, tok, random.Random(0)))
    assert traj.truncated and traj.episode.truncation == "turns" and traj.episode.turns == 2


def _episode(tok):
    engine = FakeEngine([enc(tok, "call f()</a>"), enc(tok, "done")])
    traj = asyncio.run(run_episode(engine, ToyEnv(done_after=2, rewards=[0.25, 1.0]), TASK, tok,
                                   sampling=SamplingParams()))
    return traj


def test_render_plain_has_markers_texts_and_rewards(tok):
    out = render_trajectory(_episode(tok), tok, color=False)
    assert "\x1b[" not in out
    assert out.splitlines()[0] == "== task d-3 | env toy | turns 2 | success True | reward 1.25 =="
    for piece in ("[prompt]\nQ3:", "[act 1]\ncall f()</a>", "[reward 1: 0.25]", "[obs 1]\n<obs 1>",
                  "[act 2]\ndone", "[reward 2: 1]", "[obs 2 (final, not in tokens)]\n<obs 2>"):
        assert piece in out
    order = [out.index(p) for p in ("[prompt]", "[act 1]", "[obs 1]", "[act 2]", "[obs 2")]
    assert order == sorted(order)


def test_render_color_uses_ansi_without_markers(tok):
    out = render_trajectory(_episode(tok), tok, color=True)
    assert "\x1b[32mcall f()</a>\x1b[0m" in out  # actions green
    assert "\x1b[33m<obs 1>\x1b[0m" in out  # observations yellow
    assert "[reward 1: 0.25]" in out and "[act" not in out and "[obs" not in out


def test_render_without_loop_metadata_uses_the_action_mask(tok):
    ids = enc(tok, "P") + enc(tok, "A") + enc(tok, "O") + enc(tok, "B")
    traj = Trajectory(token_ids=ids, action_mask=[0, 1, 0, 1], rollout_logprobs=[0.0, -1.0, 0.0, -1.0],
                      rewards=[0, 0.5, 0, 0], versions=[-1, 0, -1, 0], prompt_len=1, task_id="x",
                      truncated=True)
    out = render_trajectory(traj, tok, color=False)
    assert "[act 1]\nA\n[reward 1: 0.5]\n[obs 1]\nO\n[act 2]\nB\n[reward 2: 0]" in out
    assert "truncated (?)" in out.splitlines()[0]
