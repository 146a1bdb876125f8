"""saorl.envs.pyast: every parse of the built-in envs holds one lock, and a raced depth mismatch is retried.

CPython 3.11's AST conversion keeps its recursion depth in state shared by all threads; the CI run
of 2026-11-30 crashed an experiment with ``SystemError: AST constructor recursion depth mismatch``
from math_tool stepping in the runtime's worker threads."""

import ast
import sys
import threading

import pytest

from saorl.envs import pyast
from saorl.envs.code_repair import CodeRepairEnv
from saorl.envs.math_tool import evaluate_expression, repl_code

from .test_code_repair import clamp_task

MISMATCH = SystemError("AST constructor recursion depth mismatch (before=27, after=25)")


class _Flaky:
    """ast.parse that raises the race's SystemError ``fails`` times, then parses."""

    def __init__(self, fails: int, error: BaseException = MISMATCH):
        self.fails, self.error, self.calls, self.locked = fails, error, 0, []

    def __call__(self, source, mode="exec"):
        self.calls += 1
        self.locked.append(pyast._LOCK.locked())
        if self.calls <= self.fails:
            raise self.error
        return _REAL_PARSE(source, mode=mode)


_REAL_PARSE = ast.parse


def test_a_raced_mismatch_is_retried_under_the_lock_and_the_tree_is_the_plain_parse(monkeypatch):
    flaky = _Flaky(fails=2)
    monkeypatch.setattr(pyast.ast, "parse", flaky)
    tree = pyast.parse("x = (1 + 2) * 3")
    assert ast.dump(tree) == ast.dump(_REAL_PARSE("x = (1 + 2) * 3"))
    assert flaky.calls == 3 and flaky.locked == [True, True, True]
    assert not pyast._LOCK.locked()


def test_a_mismatch_that_persists_escapes_after_the_retries_and_other_system_errors_at_once(monkeypatch):
    flaky = _Flaky(fails=10**6)
    monkeypatch.setattr(pyast.ast, "parse", flaky)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        pyast.parse("1")
    assert flaky.calls == pyast.RETRIES + 1
    other = _Flaky(fails=1, error=SystemError("something else"))
    monkeypatch.setattr(pyast.ast, "parse", other)
    with pytest.raises(SystemError, match="something else"):
        pyast.parse("1")
    assert other.calls == 1 and not pyast._LOCK.locked()


@pytest.mark.parametrize("text, want", [
    ("(1, 'a', [2.5])", (1, "a", [2.5])), ("  \t-3", -3), ("{'k': None}", {"k": None}),
])
def test_literal_eval_matches_the_standard_one(text, want):
    assert pyast.literal_eval(text) == ast.literal_eval(text) == want


@pytest.mark.parametrize("text", ["__import__('os')", "f(1)", "1 +", "a\0b", "(" * 5000 + ")" * 5000])
def test_hostile_text_raises_only_parse_errors(text):
    with pytest.raises(pyast.PARSE_ERRORS):
        pyast.literal_eval(text)


def test_the_envs_parse_through_the_lock(monkeypatch):
    flaky = _Flaky(fails=1)  # each env call below would fail without the retry
    monkeypatch.setattr(pyast.ast, "parse", flaky)
    assert evaluate_expression("3*25+9") == (84, [3, 25, 9])
    flaky.calls = 0
    assert "print(_)" in repl_code("x = 2\nx * 3")
    env = CodeRepairEnv()
    env.reset(clamp_task())
    flaky.calls = 0
    assert env.step("<patch>4: if x > hi:</patch>").observation == "<out>-4 if x < hi:\n+4 if x > hi:</out>\n"
    assert flaky.calls >= 2 and all(flaky.locked)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_threads_parsing_beside_garbage_with_finalisers_never_see_a_mismatch():
    """The race for real: three threads parse while the collector runs Python finalisers in the
    middle of conversions (a tiny switch interval lets another thread in). Unprotected, this loop
    raised the SystemError about once per 3,000 parses on CPython 3.11.7."""

    class Finalised:
        def __del__(self):
            sum(range(200))

    source = "x = " + "+".join(f"({i}*({i}-1))" for i in range(200))
    errors: list[BaseException] = []

    def work():
        for _ in range(1500):
            for _ in range(50):
                cycle = Finalised()
                cycle.me = cycle
                del cycle
            try:
                pyast.parse(source)
                evaluate_expression("(312+45)*678-91")
            except BaseException as e:  # any error here is the failure being tested
                errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []



def test_format_exc_formats_under_the_lock_and_a_failure_to_format_is_one_line(monkeypatch):
    seen = []

    def fake_format_exc():
        seen.append(pyast._LOCK.locked())
        return "Traceback: formatted\n"

    monkeypatch.setattr(pyast.traceback, "format_exc", fake_format_exc)
    assert pyast.format_exc() == "Traceback: formatted\n" and seen == [True]

    def raced():
        raise MISMATCH

    monkeypatch.setattr(pyast.traceback, "format_exc", raced)
    note = pyast.format_exc()
    assert note.startswith("(traceback not formatted: SystemError: AST constructor") and note.count("\n") == 1
    assert not pyast._LOCK.locked()


def test_format_exc_of_a_real_exception_is_the_standard_traceback():
    try:
        {}["missing"]
    except KeyError:
        ours, theirs = pyast.format_exc(), __import__("traceback").format_exc()
    assert ours == theirs and ours.rstrip().endswith("KeyError: 'missing'")
