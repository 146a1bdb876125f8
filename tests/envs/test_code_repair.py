"""code_repair: the bug bank, the episode protocol, splits, demonstrations and token budgets.

Sandbox runs cost tens of ms each; this file makes about 40 of them.
"""

import ast
import json
import random
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from saorl.envs.base import Task
from saorl.envs.code_repair import CodeRepairEnv, verified_bugs
from saorl.envs.code_repair_bank import BANK, BY_NAME, TEST_ONLY, mutants
from saorl.envs.demo import play_demonstration
from saorl.envs.registry import resolve_env
from saorl.envs.sandbox import run_python

from .episodes import play


def clamp_task(bug_line=4, bug="    if x < hi:") -> Task:
    """Hand-written: clamp with `x > hi` turned into `x < hi` on line 4."""
    f = BY_NAME["clamp"]
    module = f.source.splitlines()
    fix, module[bug_line - 1] = module[bug_line - 1], bug
    data = {"func": "clamp", "kind": "wrong_operator", "module": module, "line": bug_line, "fix": fix,
            "tests": [[repr(a), repr(e)] for a, e in f.tests], "visible": 0, "decoys": [[4, "if x >= lo:"]]}
    return Task("code_repair/hand/clamp", data)


# ------------------------------------------------------------------ the bank


def test_bank_is_large_tiny_and_canonical():
    assert len(BANK) >= 24
    assert len({f.name for f in BANK}) == len(BANK)
    for f in BANK:
        assert 2 <= len(f.source.splitlines()) <= 6, f.name
        assert ast.unparse(ast.parse(f.source)) == f.source, f.name
        assert len(f.tests) >= 5, f.name
    assert set(BY_NAME) > TEST_ONLY and 4 <= len(TEST_ONLY) <= len(BANK) // 3


def test_mutants_change_exactly_one_line_and_parse():
    kinds = Counter()
    for f in BANK:
        ref = f.source.splitlines()
        for m in mutants(f):
            kinds[m.kind] += 1
            assert ref[m.line - 1] == m.fix and m.bug != m.fix
            assert m.bug[: len(m.bug) - len(m.bug.lstrip())] == m.fix[: len(m.fix) - len(m.fix.lstrip())]
            buggy = list(ref)
            buggy[m.line - 1] = m.bug
            ast.parse("\n".join(buggy))
    assert set(kinds) == {"wrong_operator", "off_by_one", "swapped_args", "wrong_constant",
                          "wrong_variable", "wrong_return"}


def test_reference_passes_and_every_kept_bug_fails_checked_independently():
    """One sandbox run of a naive checker (separate from the env's harness): every reference
    passes all its tests; every kept bug fails exactly the tests verified_bugs says it fails."""
    bugs = verified_bugs()
    assert set(bugs) == set(BY_NAME)
    jobs = []
    for f in BANK:
        assert len(bugs[f.name]) >= 3, f.name
        modules = [f.source]
        for m, failing in bugs[f.name]:
            assert failing and all(0 <= i < len(f.tests) for i in failing)
            lines = f.source.splitlines()
            lines[m.line - 1] = m.bug
            modules.append("\n".join(lines))
        jobs.append((f.name, list(f.tests), modules))
    checker = (
        "for name, tests, modules in JOBS:\n"
        "    for src in modules:\n"
        "        ns = {}\n"
        "        exec(src, ns)\n"
        "        bad = []\n"
        "        for i, (args, want) in enumerate(tests):\n"
        "            try:\n"
        "                ok = repr(ns[name](*args)) == repr(want)\n"
        "            except Exception:\n"
        "                ok = False\n"
        "            if not ok:\n"
        "                bad.append(i)\n"
        "        print(name, bad)\n"
    ).replace("JOBS", repr(jobs))
    res = run_python(checker, timeout_s=30.0, memory_mb=512)
    assert res.returncode == 0, res.stderr
    rows = iter(res.stdout.splitlines())
    for f in BANK:
        assert next(rows) == f"{f.name} []"  # the reference
        for _, failing in bugs[f.name]:
            assert next(rows) == f"{f.name} {list(failing)}"


# ------------------------------------------------------------------ episodes


def test_correct_patch_gets_full_reward_and_success():
    env = CodeRepairEnv()
    prompt = env.reset(clamp_task())
    assert prompt.startswith("Fix the bug. Test: clamp(5, 0, 3) == 3\n1 def clamp(x, lo, hi):\n")
    assert "4     if x < hi:\n" in prompt
    r1 = env.step("<patch>4: if x > hi:</patch>")
    assert not r1.done and r1.reward == 0.0
    assert r1.observation == "<out>-4 if x < hi:\n+4 if x > hi:</out>\n"
    r2 = env.step("<submit/>")
    assert r2.done and r2.reward == 1.0 and r2.info["success"] is True
    assert r2.info["passed"] == r2.info["total"] == 6
    assert r2.observation == "<out>hidden tests: 6/6 passed</out>\n"


def test_equivalent_fix_with_other_text_also_passes():
    env = CodeRepairEnv()
    res = play(env, clamp_task(), ["<patch>4:       if hi < x:   </patch>", "<submit/>"])
    assert res[-1].reward == 1.0 and res[-1].info["success"]


def test_wrong_patch_gets_fraction_or_zero():
    # line 4 becomes `if x < lo:` -> only clamp(5, 0, 3) fails (by hand: 5 > 3 is never clamped)
    for reward, want in (("fraction", 5 / 6), ("all", 0.0)):
        res = play(CodeRepairEnv(reward=reward), clamp_task(), ["<patch>4: if x < lo:</patch>", "<submit/>"])
        assert res[-1].reward == pytest.approx(want)
        assert res[-1].info["success"] is False and res[-1].info["passed"] == 5


def test_run_shows_the_visible_test_before_and_after_the_fix():
    env = CodeRepairEnv()
    res = play(env, clamp_task(), ["<run/>", "<patch>4: if x > hi:</patch>", "<run/>"])
    assert res[0].observation == "<out>FAIL clamp(5, 0, 3): got 5, expected 3</out>\n"
    assert res[2].observation == "<out>PASS clamp(5, 0, 3) == 3</out>\n"
    assert not any(r.done for r in res)


def test_run_reports_exceptions():
    env = CodeRepairEnv()
    res = play(env, clamp_task(), ["<patch>6: return x / 0</patch>", "<run/>"])
    want = "<out>FAIL clamp(5, 0, 3): got ZeroDivisionError: division by zero, expected 3</out>\n"
    assert res[1].observation == want


@pytest.mark.parametrize("action, reason", [
    ("<patch>abc</patch>", "patch must be LINE: code"),
    ("<patch>999: return x</patch>", "no line 999, the module has lines 1-6"),
    ("<patch>0: return x</patch>", "no line 0"),
    ("<patch>4: if x ></patch>", "line 4 would not parse"),
    ("<patch>6: return (</patch>", "line 6 would not parse"),
    ("<patch>3: </patch>", "patch text must be 1-100 characters"),
    ("<patch>3: a\nb</patch>", "a patch replaces one line"),
    ("hello", "expected <run/>, <patch>LINE: code</patch> or <submit/>"),
    ("x <run/>", "text before <run/>"),
    ("4: return x</patch>", "</patch> without <patch>"),
    ("", "expected <run/>"),
])
def test_malformed_actions_are_reported_and_change_nothing(action, reason):
    env = CodeRepairEnv()
    task = clamp_task()
    env.reset(task)
    r = env.step(action)
    assert not r.done and r.reward == 0.0
    assert r.observation.startswith("<out>error: ") and reason in r.observation
    assert env._lines == task.data["module"]


def test_text_after_the_stop_string_is_ignored():
    env = CodeRepairEnv()
    res = play(env, clamp_task(), ["<patch>4: if x > hi:</patch>zz", "  <submit/>\n<run/>"])
    assert res[-1].done and res[-1].reward == 1.0


def test_hostile_patch_runs_only_in_the_sandbox():
    home = Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))  # short: the patch has 100 characters
    target = home / "p"
    patch = f"return __import__('os').system('touch {target}') or x"
    assert len(patch) <= 100
    env = CodeRepairEnv()
    res = play(env, clamp_task(), [f"<patch>6: {patch}</patch>", "<run/>", "<submit/>"])
    created = target.exists()
    shutil.rmtree(home)
    assert not created
    assert res[-1].done and res[-1].info["success"] is False


def test_infinite_loop_patch_times_out_with_zero_reward():
    env = CodeRepairEnv(timeout_s=1.0)
    res = play(env, clamp_task(), ["<patch>6: while True: pass</patch>", "<submit/>"])
    assert res[-1].done and res[-1].reward == 0.0 and res[-1].info["error"] == "timed out"


def test_printing_fake_results_cannot_pass():
    # the unpatched bug passes 2 of 6 (by hand: clamp(-2, 0, 3) and clamp(3, 0, 3)); printing
    # result-like lines changes nothing: the marker is random and the host compares the values
    env = CodeRepairEnv()
    patch = "return print(*[f'@@0 {i} {chr(39)}3{chr(39)}' for i in range(6)], sep=chr(10)) or x"
    res = play(env, clamp_task(), [f"<patch>6: {patch}</patch>", "<submit/>"])
    assert res[-1].info["passed"] == 2


def test_out_of_turns_submits_automatically():
    env = CodeRepairEnv(max_turns=2)
    res = play(env, clamp_task(), ["<run/>", "<patch>4: if x > hi:</patch>"])
    assert len(res) == 2 and res[-1].done and res[-1].reward == 1.0
    want = "<out>out of turns, submitted</out>\n<out>hidden tests: 6/6 passed</out>\n"
    assert res[-1].observation.endswith(want)
    res = play(CodeRepairEnv(max_turns=1), clamp_task(), ["nonsense"])
    assert res[0].done and res[0].info["passed"] == 2 and res[0].observation.startswith("<out>error: ")


def test_protocol_misuse_and_bad_options_raise():
    env = CodeRepairEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<run/>")
    with pytest.raises(ValueError, match="reward"):
        CodeRepairEnv(reward="sum")
    with pytest.raises(ValueError, match="max_turns"):
        CodeRepairEnv(max_turns=0)
    with pytest.raises(TypeError, match="unknown options"):
        CodeRepairEnv(colour="red")
    with pytest.raises(ValueError, match="not a code_repair task"):
        env.reset(Task("x", {"family": "arith"}))
    assert resolve_env("code_repair") is CodeRepairEnv


# ------------------------------------------------------------------ tasks and splits


def test_tasks_are_deterministic_unique_and_balanced():
    env = CodeRepairEnv()
    a, b = env.generate_tasks("train", 300, seed=3), env.generate_tasks("train", 300, seed=3)
    assert a == b
    assert all(json.loads(json.dumps(t.data)) == t.data for t in a)  # tasks can go to a JSONL file
    assert [t.id for t in env.generate_tasks("train", 300, seed=4)] != [t.id for t in a]
    assert len({t.id for t in a}) == 300
    funcs = Counter(t.data["func"] for t in a)
    assert len(funcs) == len(BANK) - len(TEST_ONLY) and max(funcs.values()) <= 3 * min(funcs.values())
    assert {t.data["kind"] for t in a[:100]} >= {"wrong_operator", "off_by_one", "swapped_args"}
    big = env.generate_tasks("test", 1000, seed=0)
    assert len(big) == 1000 and len({t.id for t in big}) == 1000
    assert any("#" in t.id for t in big)  # the test pool is smaller than 1000: it repeats


def test_train_and_test_are_disjoint_by_base_function():
    env = CodeRepairEnv()
    train, test = env.generate_tasks("train", 2000, 0), env.generate_tasks("test", 500, 0)
    assert {t.data["func"] for t in test} == TEST_ONLY
    assert not {t.data["func"] for t in train} & TEST_ONLY
    assert not {t.id for t in train} & {t.id for t in test}


def test_task_fix_restores_reference_and_visible_test_fails_on_the_bug():
    env = CodeRepairEnv()
    bugs = verified_bugs()
    for t in env.generate_tasks("train", 200, 1) + env.generate_tasks("test", 100, 1):
        d = t.data
        fixed = list(d["module"])
        fixed[d["line"] - 1] = d["fix"]
        assert "\n".join(fixed) == BY_NAME[d["func"]].source
        failing = {i for m, fails in bugs[d["func"]] if m.bug == d["module"][m.line - 1] for i in fails}
        assert d["visible"] in failing


# ------------------------------------------------------------------ demonstrations and budgets


def test_demonstrations_without_errors_always_succeed():
    env, rng = CodeRepairEnv(demo_error_rate=0.0), random.Random(0)
    tasks = env.generate_tasks("train", 6, 5) + env.generate_tasks("test", 4, 5)
    for t in tasks:
        ep = play_demonstration(env, t, rng)
        actions = [a for a, _ in ep.turns]
        assert actions[-1] == "<submit/>" and actions[-2].startswith("<patch>")
        assert ep.done and ep.success and ep.reward == 1.0, (t.id, actions)


def test_demonstrations_with_errors_patch_a_decoy():
    env, rng = CodeRepairEnv(demo_error_rate=1.0), random.Random(0)
    tasks = env.generate_tasks("train", 40, 2)
    decoyed = 0
    for t in tasks:
        patch = env.demonstration(t, rng)[-2]
        decoyed += patch != f"<patch>{t.data['line']}: {t.data['fix'].strip()}</patch>"
    assert decoyed == sum(bool(t.data["decoys"]) for t in tasks) > 30
    # a same-line decoy is another verified bug of the reference, so it is known to fail
    t = next(t for t in tasks if any(ln == t.data["line"] for ln, _ in t.data["decoys"]))
    line, text = next(d for d in t.data["decoys"] if d[0] == t.data["line"])
    res = play(env, t, [f"<patch>{line}: {text}</patch>", "<submit/>"])
    assert res[-1].info["success"] is False


def test_prompt_and_action_token_budgets():
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    env, rng = CodeRepairEnv(), random.Random(0)
    tasks = env.generate_tasks("train", 1500, 0)[:1500] + env.generate_tasks("test", 400, 0)
    prompts = [env.prompt(t) for t in tasks]
    assert max(len(ids) for ids in tok(prompts)["input_ids"]) <= 120
    actions = [a for t in tasks[::5] for a in env.demonstration(t, rng)]
    actions += [f"<patch>{t.data['line']}: {t.data['fix'].strip()}</patch>" for t in tasks]
    assert max(len(ids) for ids in tok(actions)["input_ids"]) <= 40
    for a in actions:
        assert sum(a.endswith(s) for s in env.stop_strings) == 1
