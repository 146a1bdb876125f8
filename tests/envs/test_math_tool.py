import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.envs.base import Task
from saorl.envs.math_tool import (
    HINT,
    ExpressionError,
    MathToolEnv,
    _content_key,
    _random_tree,
    _render,
    _value,
    check_countdown,
    evaluate_expression,
    repl_code,
)
from saorl.models.tokenizer import load_tokenizer

from .episodes import play

ARITH = Task("t/arith", {"family": "arith", "expr": "123*457+89", "answer": 56300})
COUNTDOWN = Task("t/cd", {"family": "countdown", "numbers": [3, 7, 9, 25], "target": 84,
                          "solution": "3*25+9"})


def _fake_tool(self, code):
    """Stands in for the sandbox where a test is about episode logic, not code execution."""
    self._tool_calls += 1
    return f"<out>{evaluate_expression(code)[0]}</out>\n"


# ---------------------------------------------------------------- verifier


@pytest.mark.parametrize("text, value, literals", [
    ("3*25+9", 84, [3, 25, 9]),
    ("(7-3)*(9+25)", 136, [7, 3, 9, 25]),
    ("100-7*(25-3)", -54, [100, 7, 25, 3]),
    (" 2 * 3 ", 6, [2, 3]),
])
def test_evaluate_expression_hand_cases(text, value, literals):
    assert evaluate_expression(text) == (value, literals)


@pytest.mark.parametrize("answer, reason", [
    ("3*25+9", None),
    ("(25+3)*3", "uses [3] beyond the given numbers"),
    ("3*25+8", "uses [8] beyond"),
    ("25*3", "evaluates to 75, not 84"),
    ("25*3+9/1", "only digits"),
    ("3**2", "BinOp is not allowed"),
    ("-3+25", "UnaryOp is not allowed"),
    ("__import__('os').system('echo hi')", "only digits"),
    ("(lambda: 84)()", "only digits"),
    ("84.0", "only digits"),
    ("3*25 9", "not an expression"),
    ("(" * 200 + "3" + ")" * 200, "longer than"),
    ("(" * 59 + "3" + ")" * 59, "evaluates to 3, not 84"),
])
def test_countdown_verifier(answer, reason):
    ok, why = check_countdown(answer, [3, 7, 9, 25], 84)
    if reason is None:
        assert ok and why is None
    else:
        assert not ok and reason in why


def test_verifier_does_not_execute_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok, _ = check_countdown("__import__('pathlib').Path('pwned').touch()", [1], 1)
    assert not ok and not (tmp_path / "pwned").exists()
    with pytest.raises(ExpressionError):
        evaluate_expression("1 if True else 2")


@given(st.lists(st.integers(1, 100), min_size=1, max_size=6), st.integers(0, 10_000))
@settings(max_examples=200, deadline=None)
def test_render_round_trips_through_the_verifier(numbers, seed):
    tree = _random_tree(random.Random(seed), numbers)
    value, literals = evaluate_expression(_render(tree))
    assert value == _value(tree) and sorted(literals) == sorted(numbers)


@pytest.mark.parametrize("code, printed", [
    ("3*4", "12\n"), ("print(5)", "5\n"), ("x = 3; x * 2", "6\n"), ("x = 3", ""),
    ("1+1  # comment", "2\n"), ("None", ""), ("for i in range(2): print(i)", "0\n1\n"),
])
def test_repl_code_prints_a_final_expression_once(code, printed, capsys):
    exec(repl_code(code), {})  # trusted test inputs; the env runs this in the sandbox
    assert capsys.readouterr().out == printed
    assert repl_code("1+") == "1+"


# ---------------------------------------------------------------- episodes without tool execution


def test_answers_without_tool():
    env = MathToolEnv()
    (r,) = play(env, ARITH, ["<answer>56300</answer>"])
    assert (r.reward, r.done, r.info["success"], r.observation) == (1.0, True, True, "")
    (r,) = play(env, ARITH, ["  <answer> 56300 </answer>\n"])
    assert r.reward == 1.0
    (r,) = play(env, ARITH, ["<answer>56301</answer>"])
    assert (r.reward, r.done, r.info["success"], r.info["error"]) == (0.0, True, False, "wrong answer")
    (r,) = play(env, ARITH, ["<answer>56300 is the answer</answer>"])
    assert r.reward == 0.0 and r.done
    (r,) = play(env, ARITH, ["<answer></answer>"])
    assert r.reward == 0.0 and r.done and "empty answer" in r.observation
    # text sampled past the stop string is ignored
    (r,) = play(env, COUNTDOWN, ["<answer>3*25+9</answer>xyz"])
    assert r.reward == 1.0


@pytest.mark.parametrize("action, error", [
    ("<tool>print(1)", "missing </tool>"),
    ("The answer is <answer>56300</answer>", "text before <answer>"),
    ("56300", "expected <tool>...</tool> or <answer>...</answer>"),
    ("56300</answer>", "</answer> without <answer>"),
    ("<tool><answer>5</answer>", "text before <answer>"),
    ("<answer><tool>5</answer>", "<tool> inside <answer>"),
])
def test_malformed_actions_cost_a_turn_with_a_clear_observation(action, error):
    env = MathToolEnv(max_turns=3)
    first, second = play(env, ARITH, [action, "<answer>56300</answer>"])
    assert first.observation == f"<out>error: {error}</out>\n"
    assert (first.reward, first.done) == (0.0, False)
    assert second.reward == 1.0 and second.info["turns"] == 2


def test_out_of_turns():
    env = MathToolEnv(max_turns=2)
    results = play(env, ARITH, ["oops", "<tool>1+1</tool>"])
    assert [r.done for r in results] == [False, True]
    assert results[-1].reward == 0.0 and not results[-1].info["success"]
    assert results[-1].observation == "<out>error: out of turns</out>\n"
    assert results[-1].info["tool_calls"] == 0  # the last-turn tool call is not run
    (r,) = play(MathToolEnv(max_turns=1), ARITH, ["<tool>1+1"])
    assert r.done and r.reward == 0.0 and "out of turns (missing </tool>)" in r.observation
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>1</answer>")
    with pytest.raises(RuntimeError, match="before reset"):
        MathToolEnv().step("<answer>1</answer>")


def test_bad_options_and_tasks():
    for kwargs, field in [({"family": "algebra"}, "family"), ({"difficulty": 0}, "difficulty"),
                          ({"max_turns": 0}, "max_turns"), ({"tool_timeout_s": 0}, "tool_timeout_s"),
                          ({"demo_error_rate": 1.5}, "demo_error_rate"), ({"system": " "}, "system"),
                          ({"system": 3}, "system")]:
        with pytest.raises(ValueError, match=field):
            MathToolEnv(**kwargs)
    with pytest.raises(TypeError, match="colour"):
        MathToolEnv(colour=1)
    with pytest.raises(ValueError, match="not a math_tool task"):
        MathToolEnv().reset(Task("x", {"topic": "moon"}))


def test_system_message_makes_the_prompt_a_conversation_with_the_problem_as_the_user_turn():
    system = "Use <tool>code</tool>, then <answer>number</answer>."
    env = MathToolEnv(system=system, hint=True)
    assert env.reset(ARITH) == [{"role": "system", "content": system},
                                {"role": "user", "content": HINT + "Compute 123*457+89."}]
    assert env.step("<answer>56300</answer>").reward == 1.0
    assert MathToolEnv().reset(ARITH) == "Compute 123*457+89.\n"


# ---------------------------------------------------------------- tasks


@pytest.mark.parametrize("family", ["arith", "countdown", "mix"])
def test_tasks_deterministic_unique_and_disjoint_by_content(family):
    for difficulty in (1, 2, 3):
        env = MathToolEnv(family=family, difficulty=difficulty)
        a = env.generate_tasks("train", 200, 0)
        assert a == env.generate_tasks("train", 200, 0) and a != env.generate_tasks("train", 200, 1)
        train = a + env.generate_tasks("train", 200, 1)
        test = env.generate_tasks("test", 200, 0) + env.generate_tasks("test", 200, 1)
        assert len({t.id for t in a}) == 200
        assert not {t.id for t in train} & {t.id for t in test}
        assert not {_content_key(t.data) for t in train} & {_content_key(t.data) for t in test}
        families = {t.data["family"] for t in train}
        assert families == ({"arith", "countdown"} if family == "mix" else {family})
        for t in test[:50]:
            if t.data["family"] == "countdown":
                assert check_countdown(t.data["solution"], t.data["numbers"], t.data["target"])[0]
            else:
                assert evaluate_expression(t.data["expr"])[0] == t.data["answer"]


def test_impossible_task_count_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("saorl.envs.math_tool._arith_problem",
                        lambda rng, d: {"family": "arith", "expr": "2*3", "answer": 6})
    env = MathToolEnv()
    split = "train" if env.generate_tasks("train", 0, 0) == [] else "test"
    with pytest.raises(ValueError, match="could only find"):
        env.generate_tasks(split, 2, 0)


# ---------------------------------------------------------------- demonstrations (tool faked)


@pytest.mark.parametrize("family", ["arith", "countdown"])
def test_demonstrations_succeed_at_zero_error_rate_and_fail_at_the_set_rate(family, monkeypatch):
    monkeypatch.setattr(MathToolEnv, "_run_tool", _fake_tool)
    tasks = MathToolEnv(family=family, difficulty=2).generate_tasks("train", 100, 0)
    rng = random.Random(0)
    for rate, lo, hi in [(0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.5, 0.4, 0.6), (0.2, 0.12, 0.28)]:
        env = MathToolEnv(family=family, difficulty=2, demo_error_rate=rate)
        fails = 0
        for task in tasks * 3:
            results = play(env, task, env.demonstration(task, rng))
            assert results[-1].done
            fails += not results[-1].info["success"]
        assert lo <= fails / 300 <= hi, (rate, fails)


def test_token_budget(monkeypatch):
    monkeypatch.setattr(MathToolEnv, "_run_tool", _fake_tool)
    tok = load_tokenizer()
    n = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    rng = random.Random(0)
    for family in ("arith", "countdown"):
        for difficulty in (1, 2, 3):
            env = MathToolEnv(family=family, difficulty=difficulty, demo_error_rate=0.5)
            for task in env.generate_tasks("test", 40, 0):
                total = n(env.reset(task))
                assert total <= 60
                for action in env.demonstration(task, rng):
                    obs = env.step(action).observation
                    assert n(action) <= 40
                    total += n(action) + n(obs)
                assert total <= 300


# ---------------------------------------------------------------- with the real sandbox (a few calls)


def test_tool_call_then_answer_through_the_sandbox():
    env = MathToolEnv()
    tool, answer = play(env, ARITH, ["<tool>123*457+89</tool>", "<answer>56300</answer>"])
    assert (tool.observation, tool.reward, tool.done) == ("<out>56300</out>\n", 0.0, False)
    assert answer.reward == 1.0
    assert answer.info == {"success": True, "turns": 2, "tool_calls": 1, "error": None}
    (cd,) = play(env, COUNTDOWN, ["<tool>x = 3*25\nprint(x + 9)</tool>"])
    assert cd.observation == "<out>84</out>\n"


def test_tool_errors_are_observations_not_crashes():
    env = MathToolEnv(tool_timeout_s=1.0, max_turns=4)
    crash, loop, big, answer = play(env, ARITH, [
        "<tool>1/0</tool>", "<tool>while True: pass</tool>", "<tool>print('7' * 500)</tool>",
        "<answer>56300</answer>",
    ])
    assert crash.observation == "<out>error: ZeroDivisionError: division by zero</out>\n"
    assert loop.observation == "<out>error: timeout after 1s</out>\n"
    assert big.observation == "<out>" + "7" * 80 + "...</out>\n"
    assert not any(r.done for r in (crash, loop, big)) and crash.reward == loop.reward == 0.0
    assert answer.reward == 1.0 and answer.info["tool_calls"] == 3
    (syntax,) = play(env, ARITH, ["<tool>1+</tool>"])
    assert syntax.observation.startswith("<out>error: SyntaxError")
    (empty,) = play(env, ARITH, ["<tool> </tool>"])
    assert empty.observation == "<out>error: empty code</out>\n"


def test_demonstrations_succeed_through_the_sandbox():
    rng = random.Random(0)
    for family in ("arith", "countdown"):
        env = MathToolEnv(family=family, difficulty=3, demo_error_rate=0.0)
        for task in env.generate_tasks("test", 2, 0):
            results = play(env, task, env.demonstration(task, rng))
            assert results[-1].info["success"], (task, [r.observation for r in results])


def test_tool_code_with_a_lone_surrogate_is_an_observation_not_an_exception(sandbox_ready, monkeypatch):
    """The issue's case: "\\ud800" in tool code raised out of env.step (UnicodeEncodeError) and left
    a saorl-sbx-* dir; now the episode goes on with the error as the tool's output. The dirs checked
    are the ones this episode's sandbox made (another process's boxes, a run beside the suite, are not
    counted)."""
    import tempfile
    from pathlib import Path

    made, mkdtemp = [], tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(Path(mkdtemp(*args, **kwargs)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    env = MathToolEnv(max_turns=3)
    first, second = play(env, ARITH, ["<tool>print('\ud800')</tool>", "<answer>56300</answer>"])
    assert first.observation.startswith("<out>error: SyntaxError") and not first.done, first.observation
    assert second.reward == 1.0
    boxes = [d for d in made if d.name.startswith("saorl-sbx-")]
    assert boxes and not [d for d in boxes if d.exists()]
