"""The synthetic long-tailed env: length distribution, determinism, splits, episodes, rewards."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from saorl.envs.registry import make_env_factory
from saorl.envs.synthetic import SyntheticLengthEnv, draw_turns, lognormal_params, turns_distribution

TYPE = "saorl.envs.synthetic:SyntheticLengthEnv"


def _moments(p: list[float]) -> tuple[float, float]:
    mean = sum(k * q for k, q in enumerate(p))
    var = sum(k * k * q for k, q in enumerate(p)) - mean**2
    return mean, math.sqrt(var) / mean


def test_lognormal_params_give_the_mean_and_cv():
    mu, sigma = lognormal_params(10.0, 0.5)
    mean = math.exp(mu + sigma**2 / 2)
    cv = math.sqrt(math.exp(sigma**2) - 1)
    assert mean == pytest.approx(10.0) and cv == pytest.approx(0.5)


@pytest.mark.parametrize("mean,cv,cap", [(4.0, 1.0, 24), (4.0, 1.5, 32), (20.0, 0.5, 200)])
def test_task_turns_follow_the_configured_distribution(mean, cv, cap):
    env = SyntheticLengthEnv(mean_turns=mean, cv=cv, max_turns=cap)
    turns = [t.data["turns"] for t in env.generate_tasks("train", 20000, seed=3)]
    p = turns_distribution(mean, cv, cap)
    assert sum(p) == pytest.approx(1.0)
    exp_mean, exp_cv = _moments(p)
    got_mean = statistics.fmean(turns)
    assert got_mean == pytest.approx(exp_mean, rel=0.04)
    assert statistics.pstdev(turns) / got_mean == pytest.approx(exp_cv, rel=0.08)
    assert min(turns) >= 1 and max(turns) <= cap
    # empirical frequency of the commonest values against the discrete probabilities
    for k in (1, 2, 3):
        assert turns.count(k) / len(turns) == pytest.approx(p[k], abs=0.012)


def test_unclipped_distribution_keeps_the_configured_moments():
    # far from the clip and with a large mean, rounding hardly moves mean and CV
    mean, cv = _moments(turns_distribution(50.0, 0.5, 1000))
    assert mean == pytest.approx(50.0, rel=0.01) and cv == pytest.approx(0.5, rel=0.02)


def test_cv_zero_is_constant():
    rng = random.Random(0)
    assert {draw_turns(rng, 5.0, 0.0, 24) for _ in range(50)} == {5}


def test_tasks_are_deterministic_and_splits_disjoint():
    env = SyntheticLengthEnv()
    a, b = env.generate_tasks("train", 300, 7), env.generate_tasks("train", 300, 7)
    assert a == b
    assert env.generate_tasks("train", 300, 8) != a
    test = env.generate_tasks("test", 300, 7)
    assert not {t.id for t in a} & {t.id for t in test}
    assert [t.data for t in test] != [t.data for t in a]
    assert len({t.id for t in a}) == 300


def test_episode_ends_after_the_task_turns_with_char_fraction_reward():
    env = make_env_factory(TYPE, {"mean_turns": 3})()
    task = next(t for t in env.generate_tasks("train", 100, 0) if t.data["turns"] == 3)
    c = task.data["char"]
    assert c in env.reset(task)
    r1 = env.step(c * 4)          # all target chars: 1/3
    r2 = env.step(c + "zzz")      # a quarter: 1/12
    assert not r1.done and not r2.done and r1.observation == "\n"
    r3 = env.step("")             # nothing: 0
    assert r3.done and r3.observation == ""
    assert [r1.reward, r2.reward, r3.reward] == pytest.approx([1 / 3, 1 / 12, 0.0])
    assert r3.info["success"] is False
    env.reset(task)
    assert [env.step(c).info.get("success") for _ in range(3)][-1] is True


@pytest.mark.parametrize("opts,word", [({"mean_turns": 0.5}, "mean_turns"), ({"cv": -1}, "cv"),
                                       ({"max_turns": 0}, "max_turns"), ({"colour": 1}, "colour")])
def test_bad_options_are_named(opts, word):
    with pytest.raises(ValueError, match=word):
        make_env_factory(TYPE, opts)


def test_bad_task_data_is_reported():
    from saorl.envs.base import Task

    with pytest.raises(ValueError, match="turns"):
        SyntheticLengthEnv().reset(Task("x", {"turns": 0, "char": "a"}))
