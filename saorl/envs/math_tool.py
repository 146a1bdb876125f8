"""``math_tool``: multi-turn problems that need a Python tool, with a verifiable final answer.

An episode::

    prompt   Compute 123*457+89.\\n
    action   <tool>123*457+89</tool>          the env runs it in the sandbox
    observe  <out>56300</out>\\n
    action   <answer>56300</answer>           reward 1 if correct, else 0; episode ends

Families (option ``family``):

- ``arith``: multi-digit arithmetic (``47*815``, ``123*457+89``, ``(312+45)*678-91``) that a tiny
  model cannot do in its head; the tool computes it and the answer copies the output.
- ``countdown``: reach a target from given numbers with ``+ - *`` (parentheses allowed), each given
  number used at most once; the answer is an *expression*. The tool only checks candidates, so
  finding one is the model's job (real headroom). The answer is verified with :mod:`ast`
  (integer literals, ``+ - *`` and parentheses only), never ``eval``.
- ``mix``: each task is drawn from one of the two.

Tool code runs in :func:`saorl.envs.sandbox.run_python`; a final expression statement is printed,
as in a REPL (``<tool>3*4</tool>`` shows ``12``), so actions stay short. Malformed actions, tool
errors and timeouts produce a short ``<out>error: ...</out>`` observation and cost a turn; running
out of turns or a malformed final turn ends the episode with reward 0. Train and test tasks are
separated by a hash of the problem content, so no problem appears in both splits whatever the seeds.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from saorl.envs import pyast
from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.splits import content_hash, distinct_tasks
from saorl.envs.tags import parse_action

FAMILIES = ("arith", "countdown", "mix")
TEST_FRACTION = 0.2
MAX_ANSWER_CHARS = 120
MAX_OUT_CHARS = 80
HINT = "Use <tool>code</tool> to compute, then <answer>...</answer>.\n"
_EXPR_CHARS = re.compile(r"[0-9+\-*() ]+")
_INT = re.compile(r"-?\d+")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_LARGE = (25, 50, 75, 100)


class ExpressionError(ValueError):
    """An answer expression that is not a plain ``+ - *`` expression over the given numbers."""


def evaluate_expression(text: str) -> tuple[int, list[int]]:
    """Value and literals of an integer ``+ - *`` expression, checked with :mod:`ast`.

    Only non-negative integer literals, binary ``+ - *`` and parentheses are accepted; anything
    else (names, calls, attributes, ``**``, ``/``, unary minus, floats) raises ExpressionError.
    """
    if len(text) > MAX_ANSWER_CHARS:
        raise ExpressionError(f"expression longer than {MAX_ANSWER_CHARS} characters")
    if not _EXPR_CHARS.fullmatch(text):
        raise ExpressionError("only digits, + - * ( ) and spaces are allowed")
    try:
        tree = pyast.parse(text.strip(), mode="eval")
    except pyast.PARSE_ERRORS as e:
        raise ExpressionError(f"not an expression: {type(e).__name__}") from None
    literals: list[int] = []

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = walk(node.left), walk(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ExpressionError(f"{type(node).__name__} is not allowed")

    try:
        value = walk(tree.body)
    except RecursionError:
        raise ExpressionError("expression nested too deeply") from None
    return value, literals


def check_countdown(answer: str, numbers: list[int], target: int) -> tuple[bool, str | None]:
    """(correct, reason if not): ``answer`` uses each of ``numbers`` at most once and equals target."""
    try:
        value, literals = evaluate_expression(answer)
    except ExpressionError as e:
        return False, str(e)
    extra = Counter(literals) - Counter(numbers)
    if extra:
        return False, f"uses {sorted(extra.elements())} beyond the given numbers"
    if value != target:
        return False, f"evaluates to {value}, not {target}"
    return True, None


def repl_code(code: str) -> str:
    """``code`` with its last statement printed if it is an expression (as a REPL would).

    ``3*4`` becomes ``_ = 3*4`` plus ``print(_)`` when not None; ``print(5)`` still prints once.
    Code that does not parse is returned unchanged so the sandbox reports the SyntaxError.
    """
    try:
        tree = pyast.parse(code)
    except pyast.PARSE_ERRORS:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    show = pyast.parse("_ = None\nif _ is not None:\n    print(_)").body
    show[0].value = last.value  # type: ignore[attr-defined]
    tree.body[-1:] = show
    try:
        return ast.unparse(ast.fix_missing_locations(tree))
    except (RecursionError, ValueError):
        return code


# --------------------------------------------------------------------------- problem generation


def _render(node: Any, parent: str | None = None, right: bool = False) -> str:
    """Infix text of an expression tree (int | (op, left, right)) with minimal parentheses."""
    if isinstance(node, int):
        return str(node)
    op, a, b = node
    text = f"{_render(a, op)}{op}{_render(b, op, right=True)}"
    prec, parent_prec = (2 if op == "*" else 1), (2 if parent == "*" else 1)
    needs = parent is not None and (prec < parent_prec or (right and prec == parent_prec and parent == "-"))
    return f"({text})" if needs else text


def _value(node: Any) -> int:
    if isinstance(node, int):
        return node
    op, a, b = node
    x, y = _value(a), _value(b)
    return x + y if op == "+" else x - y if op == "-" else x * y


def _random_tree(rng: random.Random, numbers: list[int]) -> Any:
    items: list[Any] = list(numbers)
    rng.shuffle(items)
    while len(items) > 1:
        i = rng.randrange(len(items) - 1)
        a, b = items[i], items[i + 1]
        op = rng.choices("+-*", weights=(3, 2, 3))[0]
        if op == "-" and _value(a) < _value(b):
            a, b = b, a
        items[i : i + 2] = [(op, a, b)]
    return items[0]


def _arith_problem(rng: random.Random, difficulty: int) -> dict[str, Any]:
    r = rng.randint
    if difficulty == 1:
        expr = f"{r(10, 99)}*{r(100, 999)}"
    elif difficulty == 2:
        expr = f"{r(100, 999)}*{r(100, 999)}{rng.choice('+-')}{r(10, 999)}"
    elif rng.random() < 0.5:
        expr = f"{r(100, 999)}*{r(100, 999)}{rng.choice('+-')}{r(100, 999)}*{r(10, 99)}"
    else:
        expr = f"({r(100, 999)}+{r(10, 99)})*{r(100, 999)}-{r(10, 999)}"
    value, _ = evaluate_expression(expr)
    return {"family": "arith", "expr": expr, "answer": value}


def _countdown_problem(rng: random.Random, difficulty: int) -> dict[str, Any]:
    """Difficulty 1: 3 numbers in 1..20, target in 1..200. 2 and 3: 4 or 5 numbers in 1..10 (often
    one of 25/50/75/100), target in 10..999. The target is built from 2+ of the numbers, so every
    task is solvable; it never equals a single given number."""
    count = difficulty + 2
    lo, hi = (1, 200) if difficulty == 1 else (10, 999)
    while True:
        numbers = [rng.randint(1, 20 if difficulty == 1 else 10) for _ in range(count)]
        if difficulty > 1 and rng.random() < 0.6:
            numbers[0] = rng.choice(_LARGE)
        used = rng.sample(numbers, rng.randint(max(2, count - 1), count))
        tree = _random_tree(rng, used)
        target = _value(tree)
        if lo <= target <= hi and target not in numbers:
            return {"family": "countdown", "numbers": sorted(numbers), "target": target,
                    "solution": _render(tree)}


def _content_key(data: dict[str, Any]) -> tuple[Any, ...]:
    if data["family"] == "arith":
        return ("arith", data["expr"])
    return ("countdown", tuple(data["numbers"]), data["target"])


# --------------------------------------------------------------------------- the env


class MathToolEnv(Env):
    name: ClassVar[str] = "math_tool"
    stop_strings: ClassVar[tuple[str, ...]] = ("</tool>", "</answer>")

    def __init__(
        self,
        family: str = "arith",
        difficulty: int = 1,
        max_turns: int = 4,
        tool_timeout_s: float = 5.0,
        demo_error_rate: float = 0.5,
        hint: bool = False,
        system: str | None = None,
        **options: Any,
    ) -> None:
        """Options: ``family`` (arith | countdown | mix), ``difficulty`` (1..3), ``max_turns``
        (actions per episode, >= 1), ``tool_timeout_s``, ``demo_error_rate`` (probability that a
        demonstration is a failing one), ``hint`` (prepend a one-line format instruction, for
        pretrained models that have not seen demonstrations), ``system`` (a system message stating
        the protocol for a chat model: the prompt is then a conversation, that message and the
        problem as the user's, rendered by the policy's chat template)."""
        super().__init__(**options)
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if difficulty not in (1, 2, 3):
            raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s!r}")
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ValueError(f"system must be a non-empty string or null, got {system!r}")
        if not 0.0 <= demo_error_rate <= 1.0:
            raise ValueError(f"demo_error_rate must be in [0, 1], got {demo_error_rate!r}")
        self.family, self.difficulty, self.max_turns = family, difficulty, max_turns
        self.tool_timeout_s, self.demo_error_rate, self.hint = float(tool_timeout_s), demo_error_rate, hint
        self.system = system
        self._task: Task | None = None
        self._turn = 0
        self._tool_calls = 0
        self._done = False

    # ---------------------------------------------------------------- tasks

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """``n`` distinct problems whose content hashes into ``split`` (20% of content is test)."""

        def draw(rng: random.Random) -> tuple[str, Callable[[str], Task]]:
            family = self.family if self.family != "mix" else rng.choice(("arith", "countdown"))
            maker = _arith_problem if family == "arith" else _countdown_problem
            data = maker(rng, self.difficulty)
            return content_hash(*_content_key(data)), lambda digest: Task(
                f"math_tool/{family}/{digest[:16]}", data | {"difficulty": self.difficulty})

        rng = random.Random(f"math_tool/{split}/{self.family}/{self.difficulty}/{seed}")
        return distinct_tasks(split, n, rng, draw, TEST_FRACTION,
                              f"problems of family {self.family!r}, difficulty {self.difficulty}")

    def prompt(self, task: Task) -> str:
        d = task.data
        if d["family"] == "arith":
            text = f"Compute {d['expr']}.\n"
        else:
            nums = " ".join(str(x) for x in d["numbers"])
            text = f"Make {d['target']} from {nums} with + - *, each at most once.\n"
        return (HINT + text) if self.hint else text

    # ---------------------------------------------------------------- episode

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        family = task.data.get("family")
        if family not in ("arith", "countdown"):
            raise ValueError(f"task {task.id!r} is not a math_tool task (family={family!r})")
        self._task, self._turn, self._tool_calls, self._done = task, 0, 0, False
        if self.system is None:
            return self.prompt(task)
        user = self.prompt(task).strip()
        return [{"role": "system", "content": self.system}, {"role": "user", "content": user}]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("MathToolEnv.step called before reset")
        if self._done:
            raise RuntimeError("MathToolEnv.step called after the episode ended")
        self._turn += 1
        parsed = parse_action(action, ("tool", "answer"))
        if parsed.tag == "answer":
            return self._finish(parsed.body)
        if self._turn >= self.max_turns:
            reason = "out of turns" + (f" ({parsed.error})" if parsed.error else "")
            return self._end(False, f"<out>error: {reason}</out>\n", reason)
        if parsed.tag == "tool":
            return StepResult(self._run_tool(parsed.body), 0.0, False, {"tool_calls": self._tool_calls})
        return StepResult(f"<out>error: {parsed.error}</out>\n", 0.0, False,
                          {"tool_calls": self._tool_calls, "error": parsed.error})

    def _finish(self, body: str) -> StepResult:
        assert self._task is not None
        d, answer = self._task.data, body.strip()
        if not answer:
            return self._end(False, "<out>error: empty answer</out>\n", "empty answer")
        if d["family"] == "arith":
            ok = bool(_INT.fullmatch(answer)) and int(answer) == d["answer"]
            reason = None if ok else "wrong answer"
        else:
            ok, reason = check_countdown(answer, d["numbers"], d["target"])
        return self._end(ok, "", reason)

    def _end(self, success: bool, observation: str, reason: str | None) -> StepResult:
        self._done = True
        info = {"success": success, "turns": self._turn, "tool_calls": self._tool_calls, "error": reason}
        return StepResult(observation, 1.0 if success else 0.0, True, info)

    def _run_tool(self, code: str) -> str:
        from saorl.envs.sandbox import run_python

        self._tool_calls += 1
        code = code.strip()
        if not code:
            return "<out>error: empty code</out>\n"
        res = run_python(repl_code(code), timeout_s=self.tool_timeout_s)
        if res.timed_out:
            text = f"error: timeout after {self.tool_timeout_s:g}s"
        elif res.returncode != 0:
            lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
            why = f"killed ({res.killed_reason})" if res.killed_reason else f"exit code {res.returncode}"
            text = "error: " + (lines[-1].strip() if lines else why)
        else:
            text = res.stdout.strip()
        if len(text) > MAX_OUT_CHARS:
            text = text[:MAX_OUT_CHARS] + "..."
        return f"<out>{text}</out>\n"

    # ---------------------------------------------------------------- demonstrations

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """A correct solution, or with probability ``demo_error_rate`` a failing one.

        arith, correct: tool call, then the answer copying its output. Failing: a guessed
        answer without the tool, a typo when copying, or a typo in the tool call.
        countdown, correct: check the solution with the tool, then answer it (sometimes after
        checking a wrong candidate first). Failing: a wrong candidate answered with or without
        checking it.
        """
        fail = rng.random() < self.demo_error_rate
        if task.data["family"] == "arith":
            return self._arith_demo(task.data, rng, fail)
        return self._countdown_demo(task.data, rng, fail)

    def _arith_demo(self, d: dict[str, Any], rng: random.Random, fail: bool) -> list[str]:
        expr, answer = d["expr"], str(d["answer"])
        if self.max_turns < 2:
            return [f"<answer>{_typo(answer, rng) if fail else answer}</answer>"]
        if not fail:
            return [f"<tool>{expr}</tool>", f"<answer>{answer}</answer>"]
        kind = rng.randrange(3)
        if kind == 0:
            return [f"<answer>{_typo(answer, rng)}</answer>"]
        if kind == 1:
            return [f"<tool>{expr}</tool>", f"<answer>{_typo(answer, rng)}</answer>"]
        bad = _typo_expr(expr, rng)
        return [f"<tool>{bad}</tool>", f"<answer>{evaluate_expression(bad)[0]}</answer>"]

    def _countdown_demo(self, d: dict[str, Any], rng: random.Random, fail: bool) -> list[str]:
        solution = d["solution"]
        if self.max_turns < 2:
            return [f"<answer>{_wrong_candidate(d, rng) if fail else solution}</answer>"]
        if fail:
            wrong = _wrong_candidate(d, rng)
            if rng.random() < 0.5:
                return [f"<answer>{wrong}</answer>"]
            return [f"<tool>{wrong}</tool>", f"<answer>{wrong}</answer>"]
        if self.max_turns >= 3 and rng.random() < 0.3:
            wrong = _wrong_candidate(d, rng)
            return [f"<tool>{wrong}</tool>", f"<tool>{solution}</tool>", f"<answer>{solution}</answer>"]
        return [f"<tool>{solution}</tool>", f"<answer>{solution}</answer>"]


def _typo(number: str, rng: random.Random) -> str:
    """``number`` with one digit changed (never the leading digit to 0): always a different value."""
    digits = [i for i, c in enumerate(number) if c.isdigit()]
    i = rng.choice(digits)
    first = i == digits[0] and len(digits) > 1
    choices = [c for c in "0123456789" if c != number[i] and not (first and c == "0")]
    return number[:i] + rng.choice(choices) + number[i + 1 :]


def _typo_expr(expr: str, rng: random.Random) -> str:
    """``expr`` with one digit of one operand changed, chosen so that its value changes."""
    for _ in range(20):
        spans = [m.span() for m in re.finditer(r"\d+", expr)]
        a, b = rng.choice(spans)
        bad = expr[:a] + _typo(expr[a:b], rng) + expr[b:]
        if evaluate_expression(bad)[0] != evaluate_expression(expr)[0]:
            return bad
    return expr + "+1"


def _wrong_candidate(d: dict[str, Any], rng: random.Random) -> str:
    """A plausible expression over the given numbers that does not reach the target."""
    numbers = d["numbers"]
    for _ in range(50):
        used = rng.sample(numbers, rng.randint(2, len(numbers)))
        tree = _random_tree(rng, used)
        if _value(tree) != d["target"]:
            return _render(tree)
    return str(min(numbers))  # targets never equal a single given number
