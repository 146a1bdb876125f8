import random
import re

import pytest

from saorl.envs.base import Task
from saorl.envs.math_levels import DEFAULT_LEVELS, MathLevelsEnv, parse_levels
from saorl.envs.math_tool import MathToolEnv, _content_key, check_countdown, evaluate_expression

from .episodes import play


def _fake_tool(self, code):
    """Stands in for the sandbox: these tests are about tasks, prompts and rewards."""
    self._tool_calls += 1
    return f"<out>{evaluate_expression(code)[0]}</out>\n"


def test_levels_parse_and_bad_options():
    assert parse_levels(["arith:1", "countdown:3"]) == (("arith", 1), ("countdown", 3))
    for bad in (["algebra:1"], ["arith:4"], ["arith"], "arith:1", [], ["arith:1", "arith:1"]):
        with pytest.raises(ValueError, match="levels"):
            MathLevelsEnv(levels=bad)
    with pytest.raises(ValueError, match="no 'family' option"):
        MathLevelsEnv(family="arith")
    with pytest.raises(ValueError, match="demo_error_rate"):
        MathLevelsEnv(demo_error_rate=2)
    with pytest.raises(TypeError, match="colour"):
        MathLevelsEnv(colour=1)


def test_tasks_deterministic_disjoint_and_every_level_named_in_its_prompt():
    env = MathLevelsEnv()
    a = env.generate_tasks("train", 300, 0)
    assert a == env.generate_tasks("train", 300, 0) and a != env.generate_tasks("train", 300, 1)
    assert len({t.id for t in a}) == 300
    test = env.generate_tasks("test", 300, 0) + env.generate_tasks("test", 300, 1)
    train = a + env.generate_tasks("train", 300, 1)
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {_content_key(t.data) for t in train} & {_content_key(t.data) for t in test}
    counts = {}
    for t in a:
        level = t.data["level"]
        family, difficulty = DEFAULT_LEVELS[level - 1].split(":")
        assert (t.data["family"], t.data["difficulty"]) == (family, int(difficulty))
        assert t.id.startswith(f"math_levels/L{level}/")
        prompt = env.reset(t)
        assert prompt.startswith(f"Level {level}. ")
        assert prompt.removeprefix(f"Level {level}. ") == MathToolEnv(family=family).prompt(t)
        counts[level] = counts.get(level, 0) + 1
    assert sorted(counts) == [1, 2, 3, 4] and min(counts.values()) > 50  # uniform over 4 levels
    for t in test[:80]:
        d = t.data
        if d["family"] == "countdown":
            assert check_countdown(d["solution"], d["numbers"], d["target"])[0]
        else:
            assert evaluate_expression(d["expr"])[0] == d["answer"]


def test_custom_levels():
    env = MathLevelsEnv(levels=["countdown:2", "arith:2"])
    tasks = env.generate_tasks("train", 60, 0)
    kinds = {(t.data["level"], t.data["family"], t.data["difficulty"]) for t in tasks}
    assert kinds == {(1, "countdown", 2), (2, "arith", 2)}
    assert all(re.match(r"Level [12]\. ", env.reset(t)) for t in tasks)


def test_rewards_on_hand_made_actions(monkeypatch):
    monkeypatch.setattr(MathToolEnv, "_run_tool", _fake_tool)
    env = MathLevelsEnv()
    arith = Task("a", {"family": "arith", "expr": "27*555", "answer": 14985, "difficulty": 1, "level": 1})
    countdown = Task("c", {"family": "countdown", "numbers": [3, 7, 9, 25], "target": 84,
                           "solution": "3*25+9", "difficulty": 3, "level": 4})
    tool, answer = play(env, arith, ["<tool>27*555</tool>", "<answer>14985</answer>"])
    assert tool.observation == "<out>14985</out>\n" and (answer.reward, answer.info["success"]) == (1.0, True)
    (wrong,) = play(env, arith, ["<answer>14986</answer>"])
    assert (wrong.reward, wrong.info["success"]) == (0.0, False)
    (right,) = play(env, countdown, ["<answer>9+3*25</answer>"])
    assert right.reward == 1.0
    (reused,) = play(env, countdown, ["<answer>3*25+9+0*3</answer>"])
    assert reused.reward == 0.0 and "beyond the given numbers" in reused.info["error"]
    with pytest.raises(ValueError, match="not a math_levels task"):
        env.reset(Task("x", {"family": "arith", "expr": "1*2", "answer": 2}))


def test_demonstrations_succeed_on_every_level(monkeypatch):
    monkeypatch.setattr(MathToolEnv, "_run_tool", _fake_tool)
    env = MathLevelsEnv(demo_error_rate=0.0)
    rng = random.Random(0)
    tasks = env.generate_tasks("train", 80, 0)
    for task in tasks:
        results = play(env, task, env.demonstration(task, rng))
        assert results[-1].done and results[-1].info["success"], task
    failing = MathLevelsEnv(demo_error_rate=1.0)
    assert not any(play(failing, t, failing.demonstration(t, rng))[-1].info["success"] for t in tasks)
