"""``code_repair``: a miniature SWE-Bench. Fix a one-line bug in a tiny function until its tests pass.

An episode (the prompt shows the buggy module with line numbers and one failing visible test)::

    prompt   Fix the bug. Test: clamp(5, 0, 3) == 3
             1 def clamp(x, lo, hi):
             2     if x < lo:
             3         return lo
             4     if x < hi:
             5         return hi
             6     return x
    action   <run/>                     run the visible test in the sandbox
    observe  <out>FAIL clamp(5, 0, 3): got 5, expected 3</out>
    action   <patch>4: if x > hi:</patch>
    observe  <out>-4 if x < hi:
             +4 if x > hi:</out>
    action   <submit/>                  run the HIDDEN tests on the patched module; episode ends
    observe  <out>hidden tests: 6/6 passed</out>

Edit format: ``<patch>LINE: new text</patch>`` replaces line ``LINE`` (1-based, as numbered in the
prompt) with ``new text``. Leading and trailing whitespace of the new text is dropped and the line
keeps its original indentation, so a patch never needs to count spaces (and can never change the
block structure). A patch is checked with ``ast.parse`` before it is applied (parsing runs no code);
one that would not parse is rejected and the module stays as it was.

Every action costs a turn. Malformed actions, bad line numbers and unparsable patches produce a
short ``<out>error: ...</out>`` observation and the episode goes on. When the turns run out
(``max_turns``, default 5) the env submits automatically: the hidden tests are run on the module as
patched so far. All model-influenced code runs only in :func:`saorl.envs.sandbox.run_python`; the
expected outputs never enter the sandbox (the harness prints ``repr`` of each result, the host
compares), so a patch cannot fake a pass by printing.

Reward at the end: the fraction of hidden tests passing (``reward="fraction"``) or 1/0 for all of
them (``reward="all"``); ``info["success"]`` is whether all pass. The hidden tests are all the
function's tests, the visible one included (as in SWE-Bench's FAIL_TO_PASS set).

Budgets (shipped tokenizer, all tasks): prompts <= 111 tokens (``hint`` adds 30), demonstration
actions <= 32 tokens; ~1,300 train and ~400 test tasks.

Tasks: each bug from :mod:`saorl.envs.code_repair_bank` is run once (one sandbox call per process,
cached) against the function's tests; a bug that passes them all is dropped, and the reference must
pass them all. A task is (bug, visible test) where the visible test is one the bug fails. The train
split uses only functions outside ``TEST_ONLY``, the test split only those in it. Tasks are
interleaved over (function, bug kind) so that any prefix is balanced; when more tasks are asked for
than exist, the list repeats with ``#k`` appended to the ids.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import secrets
from collections import defaultdict
from typing import Any, ClassVar

from saorl.envs import pyast
from saorl.envs.base import Env, Progress, Split, StepResult, Task
from saorl.envs.code_repair_bank import BANK, TEST_ONLY, BaseFunction, Mutant, mutants
from saorl.envs.splits import content_hash

MAX_PATCH_CHARS = 100
MAX_OUT_CHARS = 80
HINT = "Actions: <run/> <patch>LINE: code</patch> <submit/>\n"
_STOPS = ("</patch>", "<run/>", "<submit/>")
_PATCH = re.compile(r"\s*<patch>(.*)</patch>", re.S)
_PATCH_BODY = re.compile(r"\s*(\d+)\s*:(.*)", re.S)

# Runs inside the sandbox. `_cases` yields repr(result) or "!Error: msg" per test, never raises.
_RUNNER = '''
import ast, sys


def _error(e):
    return "!" + type(e).__name__ + (": " + str(e) if str(e) else "")


def _cases(src, name, cases):
    ns = {"__name__": "solution"}
    try:
        exec(compile(src, "solution.py", "exec"), ns)
        fn = ns[name]
    except BaseException as e:
        fn, out = None, _error(e)
    for args in cases:
        if fn is not None:  # else every case reports the load error
            try:
                out = repr(fn(*ast.literal_eval(args)))
            except BaseException as e:
                out = _error(e)
        yield out[:200]  # outside the try: a generator must not swallow GeneratorExit
'''


def _episode_script(src: str, name: str, cases: list[str], mark: str) -> str:
    return _RUNNER + (
        "_out = sys.stdout\n"
        f"for _i, _r in enumerate(_cases({src!r}, {name!r}, {cases!r})):\n"
        f"    _out.write({mark!r} + ' ' + str(_i) + ' ' + repr(_r) + '\\n')\n"
        "    _out.flush()\n"
    )


def _batch_script(jobs: list[Any]) -> str:
    """Each job is (name, cases, expected reprs, modules); prints one string per module with, per
    test, 1 (pass), 0 (fail) or T (slower than 0.5 s: an infinite loop, say)."""
    return _RUNNER + (
        "import signal\n"
        "def _alarm(*_):\n"
        "    raise TimeoutError('@slow')\n"
        "signal.signal(signal.SIGALRM, _alarm)\n"
        f"for name, cases, expected, modules in {jobs!r}:\n"
        "    for src in modules:\n"
        "        gen, bits = _cases(src, name, cases), ''\n"
        "        for e in expected:\n"
        "            signal.setitimer(signal.ITIMER_REAL, 0.5)\n"
        "            r = next(gen)\n"
        "            signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "            bits += 'T' if r == '!TimeoutError: @slow' else '1' if r == e else '0'\n"
        "            if bits[-1] == 'T':\n"
        "                break\n"
        "        print(bits)\n"
    )


def _call_text(name: str, args_repr: str) -> str:
    return f"{name}{args_repr[:-2]})" if args_repr.endswith(",)") else f"{name}{args_repr}"


def _module_with(lines: list[str], line: int, text: str) -> list[str]:
    out = list(lines)
    out[line - 1] = text
    return out


@functools.cache
def verified_bugs() -> dict[str, list[tuple[Mutant, tuple[int, ...]]]]:
    """For every bank function, its bugs that fail at least one test, each with the indices of the
    tests it fails. Bugs that hang on a test are dropped too (each episode would pay the timeout).
    One sandbox run for the whole bank; raises if a reference fails a test."""
    from saorl.envs.sandbox import run_python

    jobs, order = [], []
    for f in BANK:
        ms = mutants(f)
        lines = f.source.splitlines()
        modules = [f.source] + ["\n".join(_module_with(lines, m.line, m.bug)) for m in ms]
        jobs.append((f.name, [repr(a) for a, _ in f.tests], [repr(e) for _, e in f.tests], modules))
        order.append((f, ms))
    res = run_python(_batch_script(jobs), timeout_s=60.0, memory_mb=512)
    rows = res.stdout.split()
    if res.returncode != 0 or len(rows) != sum(len(j[3]) for j in jobs):
        raise RuntimeError(f"code_repair: verifying the bug bank failed (rc={res.returncode}, "
                           f"timed_out={res.timed_out}): {res.stderr[-500:]}")
    out: dict[str, list[tuple[Mutant, tuple[int, ...]]]] = {}
    for f, ms in order:
        ref, *bits = rows[:1 + len(ms)]
        rows = rows[1 + len(ms):]
        if ref != "1" * len(f.tests):
            raise RuntimeError(f"code_repair: reference {f.name!r} fails its own tests ({ref})")
        out[f.name] = [(m, tuple(i for i, b in enumerate(b_) if b == "0"))
                       for m, b_ in zip(ms, bits) if "0" in b_ and "T" not in b_]
    return out


def _task_data(f: BaseFunction, m: Mutant, visible: int, decoys: list[list[Any]]) -> dict[str, Any]:
    lines = f.source.splitlines()
    return {"func": f.name, "kind": m.kind, "module": _module_with(lines, m.line, m.bug),
            "line": m.line, "fix": m.fix, "tests": [[repr(a), repr(e)] for a, e in f.tests],
            "visible": visible, "decoys": decoys}


def _decoys(m: Mutant, bugs: list[tuple[Mutant, tuple[int, ...]]], rng: random.Random) -> list[list[Any]]:
    """Plausible wrong patches for failing demonstrations: another verified bug of the same line (so
    the patched module is known to fail) and a bug on another line (the real bug stays)."""
    same = [o for o, _ in bugs if o.line == m.line and o.bug != m.bug]
    other = [o for o, _ in bugs if o.line != m.line]
    picks = rng.sample(same, min(2, len(same))) + rng.sample(other, min(2, len(other)))
    return [[o.line, o.bug.strip()] for o in picks]


def _pool(split: Split) -> dict[tuple[str, str], list[Task]]:
    """All tasks of ``split`` grouped by (function, bug kind); deterministic, independent of seeds."""
    groups: dict[tuple[str, str], list[Task]] = defaultdict(list)
    bugs = verified_bugs()
    for f in BANK:
        if (f.name in TEST_ONLY) != (split == "test"):
            continue
        for m, failing in bugs[f.name]:
            rng = random.Random(f"code_repair/{f.name}/{m.line}/{m.bug}")
            decoys = _decoys(m, bugs[f.name], rng)
            for visible in failing:
                data = _task_data(f, m, visible, decoys)
                digest = content_hash(f.name, "\n".join(data["module"]), visible)
                groups[(f.name, m.kind)].append(Task(f"code_repair/{f.name}/{digest[:16]}", data))
    return groups


def _interleave(groups: dict[tuple[str, str], list[Task]], rng: random.Random) -> list[Task]:
    keys = sorted(groups)
    rng.shuffle(keys)
    queues = [rng.sample(groups[k], len(groups[k])) for k in keys]
    out: list[Task] = []
    for r in range(max(len(q) for q in queues)):
        out.extend(q[r] for q in queues if r < len(q))
    return out


class CodeRepairEnv(Env):
    name: ClassVar[str] = "code_repair"
    stop_strings: ClassVar[tuple[str, ...]] = _STOPS

    def __init__(
        self,
        reward: str = "fraction",
        max_turns: int = 5,
        timeout_s: float = 5.0,
        demo_error_rate: float = 0.5,
        hint: bool = False,
        **options: Any,
    ) -> None:
        """Options: ``reward`` (fraction | all), ``max_turns`` (actions per episode, >= 1; the last
        one is followed by an automatic submit), ``timeout_s`` (per sandbox run),
        ``demo_error_rate`` (probability that a demonstration patches wrongly), ``hint`` (prepend a
        one-line format reminder, for pretrained models that have not seen demonstrations)."""
        super().__init__(**options)
        if reward not in ("fraction", "all"):
            raise ValueError(f"reward must be 'fraction' or 'all', got {reward!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not 0.0 <= demo_error_rate <= 1.0:
            raise ValueError(f"demo_error_rate must be in [0, 1], got {demo_error_rate!r}")
        self.reward, self.max_turns, self.timeout_s = reward, max_turns, float(timeout_s)
        self.demo_error_rate, self.hint = demo_error_rate, hint
        self._task: Task | None = None
        self._lines: list[str] = []
        self._turn = 0
        self._done = False

    # ---------------------------------------------------------------- tasks

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split``, balanced over (function, bug kind); repeats past the pool."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        pool = _interleave(_pool(split), random.Random(f"code_repair/{split}/{seed}"))
        out = pool[:n]
        for i in range(len(pool), n):
            t = pool[i % len(pool)]
            out.append(Task(f"{t.id}#{i // len(pool)}", t.data))
        return out

    def prompt(self, task: Task) -> str:
        d = task.data
        args, expected = d["tests"][d["visible"]]
        numbered = "".join(f"{i} {line}\n" for i, line in enumerate(d["module"], 1))
        text = f"Fix the bug. Test: {_call_text(d['func'], args)} == {expected}\n{numbered}"
        return (HINT + text) if self.hint else text

    # ---------------------------------------------------------------- episode

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        missing = {"func", "module", "tests", "visible"} - set(task.data)
        if missing:
            raise ValueError(f"task {task.id!r} is not a code_repair task (missing {sorted(missing)})")
        self._task, self._lines = task, list(task.data["module"])
        self._turn, self._done = 0, False
        return self.prompt(task)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("CodeRepairEnv.step called before reset")
        if self._done:
            raise RuntimeError("CodeRepairEnv.step called after the episode ended")
        self._turn += 1
        kind, text = self._parse(action)
        if kind == "submit":
            return self._submit("")
        if kind == "run":
            obs = self._run_visible()
        elif kind == "patch":
            obs = self._patch(text)
        else:
            obs = f"<out>error: {text}</out>\n"
        if self._turn >= self.max_turns:
            return self._submit(obs + "<out>out of turns, submitted</out>\n")
        return StepResult(obs, 0.0, False, {"turns": self._turn, "error": text if kind == "error" else None})

    @staticmethod
    def _parse(action: str) -> tuple[str, str]:
        """('run'|'submit'|'patch'|'error', patch body or error reason). Text after the first
        stop string is dropped (an engine may overshoot it by part of a token)."""
        ends = [(action.find(s), s) for s in _STOPS if s in action]
        if not ends:
            return "error", "expected <run/>, <patch>LINE: code</patch> or <submit/>"
        at, stop = min(ends)
        head = action[:at + len(stop)]
        if stop != "</patch>":
            if head[:at].strip():
                return "error", f"text before {stop}"
            return ("run" if stop == "<run/>" else "submit"), ""
        m = _PATCH.fullmatch(head)
        if m is None:
            return "error", "text before <patch>" if "<patch>" in head else "</patch> without <patch>"
        return "patch", m.group(1)

    def _patch(self, body: str) -> str:
        m = _PATCH_BODY.fullmatch(body)
        if m is None:
            return "<out>error: patch must be LINE: code</out>\n"
        line, text = int(m.group(1)), m.group(2).strip()
        if not 1 <= line <= len(self._lines):
            return f"<out>error: no line {line}, the module has lines 1-{len(self._lines)}</out>\n"
        if "\n" in text or "\r" in text:
            return "<out>error: a patch replaces one line</out>\n"
        if not text or len(text) > MAX_PATCH_CHARS:
            return f"<out>error: patch text must be 1-{MAX_PATCH_CHARS} characters</out>\n"
        old = self._lines[line - 1]
        new = old[: len(old) - len(old.lstrip())] + text
        lines = _module_with(self._lines, line, new)
        try:
            pyast.parse("\n".join(lines))
        except pyast.PARSE_ERRORS as e:
            reason = getattr(e, "msg", None) or type(e).__name__
            return f"<out>error: line {line} would not parse ({reason}), not applied</out>\n"
        self._lines = lines
        return f"<out>-{line} {old.strip()}\n+{line} {text}</out>\n"

    def _execute(self, indices: list[int]) -> tuple[list[str | None], str | None]:
        """Run the current module on the given tests in the sandbox: (repr of each result, or None
        where no result came back; a note such as 'timed out' or None)."""
        from saorl.envs.sandbox import run_python

        assert self._task is not None
        d, mark = self._task.data, "@@" + secrets.token_hex(8)
        cases = [d["tests"][i][0] for i in indices]
        script = _episode_script("\n".join(self._lines), d["func"], cases, mark)
        res = run_python(script, timeout_s=self.timeout_s)
        results: list[str | None] = [None] * len(indices)
        for row in res.stdout.splitlines():
            head, _, value = row.partition(" ")
            idx, _, text = value.partition(" ")
            if head == mark and idx.isdigit() and int(idx) < len(results) and results[int(idx)] is None:
                with contextlib.suppress(*pyast.PARSE_ERRORS):
                    results[int(idx)] = str(pyast.literal_eval(text))
        note = None
        if res.timed_out:
            note = "timed out"
        elif res.killed_reason is not None:
            note = f"killed ({res.killed_reason})"
        elif None in results:
            note = f"crashed (exit code {res.returncode})"
        return results, note

    def _run_visible(self) -> str:
        assert self._task is not None
        d = self._task.data
        (got,), note = self._execute([d["visible"]])
        args, expected = d["tests"][d["visible"]]
        call = _call_text(d["func"], args)
        if got == expected:
            text = f"PASS {call} == {expected}"
        else:
            shown = note if got is None else (got[1:] if got.startswith("!") else got)
            text = f"FAIL {call}: got {shown[:MAX_OUT_CHARS]}, expected {expected}"
        return f"<out>{text}</out>\n"

    def _submit(self, prefix: str) -> StepResult:
        assert self._task is not None
        tests = self._task.data["tests"]
        got, note = self._execute(list(range(len(tests))))
        passed = sum(g == e for g, (_, e) in zip(got, tests))
        success = passed == len(tests)
        reward = passed / len(tests) if self.reward == "fraction" else float(success)
        self._done = True
        obs = prefix + f"<out>hidden tests: {passed}/{len(tests)} passed</out>\n"
        info = {"success": success, "passed": passed, "total": len(tests), "turns": self._turn,
                "error": note}
        return StepResult(obs, reward, True, info)

    # ---------------------------------------------------------------- demonstrations

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """``[<run/>,] <patch>, <submit/>``: the reference fix, or with probability
        ``demo_error_rate`` a decoy (another bug on the same line, known to fail, or a bug put on
        another line while the real one stays). ``<run/>`` comes first half of the time."""
        d = task.data
        actions = ["<run/>"] if rng.random() < 0.5 else []
        line, text = d["line"], d["fix"].strip()
        if d["decoys"] and rng.random() < self.demo_error_rate:
            line, text = rng.choice(d["decoys"])
        return [*actions, f"<patch>{line}: {text}</patch>", "<submit/>"]
