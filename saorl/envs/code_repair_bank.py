"""The bank of base functions for ``code_repair`` and the single-line bug injector.

Each :class:`BaseFunction` is a tiny correct Python function (a ``def`` line and 1-5 body lines,
written in the canonical form ``ast.unparse`` prints, so a mutated tree unparses to the same text
everywhere except the mutated line) with hand-written unit tests ``(args, expected)``.

:func:`mutants` enumerates bugs by editing the ``ast`` of the body, one node at a time:

- ``wrong_operator``: ``+``/``-``, ``*``->``+``, ``/``/``//``, ``%``->``//``, ``<``/``<=``,
  ``>``/``>=``, ``==``/``!=``, ``in``/``not in``, ``and``/``or``;
- ``off_by_one``: an int constant ±1, a ``range`` bound ±1, a subscript index ±1;
- ``swapped_args``: the first two arguments of a call, or the operands of ``-``, ``/``, ``//``,
  ``%``, ``+`` or a comparison;
- ``wrong_constant``: an int or str constant replaced by another constant of the same function
  (a str with one character dropped when it has none), ``True``/``False``;
- ``wrong_variable``: a local or parameter read replaced by another (``wrong_return`` when the read
  is the whole ``return`` value), or ``max``/``min`` swapped.

A mutant is kept only if the program still parses and exactly one line changed; whether it really
breaks a test is checked by running it (in the sandbox, see ``code_repair.py``). Equivalent mutants
(``total + x`` -> ``x + total``) die there.

Split: the functions in :data:`TEST_ONLY` never appear in the train split, so the test split
measures repair of unseen code, not recall of seen fixes.
"""

from __future__ import annotations

import ast
import copy
import itertools
from dataclasses import dataclass
from typing import Any

from saorl.envs import pyast


@dataclass(frozen=True)
class BaseFunction:
    name: str
    source: str
    """The correct function, canonical ``ast.unparse`` text, no trailing newline."""
    tests: tuple[tuple[tuple[Any, ...], Any], ...]
    """``(args, expected)``; args and expected are Python literals (``repr`` round-trips)."""


@dataclass(frozen=True)
class Mutant:
    func: str
    kind: str
    line: int
    """1-based line of the bug (line 1 is the ``def``)."""
    bug: str
    """The buggy line, with its indentation."""
    fix: str
    """The reference line, with its indentation."""


def _f(name: str, source: str, *tests: tuple[tuple[Any, ...], Any]) -> BaseFunction:
    return BaseFunction(name, source.strip("\n"), tuple(tests))


BANK: tuple[BaseFunction, ...] = (
    _f("clamp", """
def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
""", ((5, 0, 3), 3), ((-2, 0, 3), 0), ((2, 0, 3), 2), ((0, 0, 3), 0), ((3, 0, 3), 3), ((7, 1, 9), 7)),
    _f("mean", """
def mean(xs):
    total = 0
    for x in xs:
        total = total + x
    return total / len(xs)
""", (([1, 2, 3],), 2.0), (([4],), 4.0), (([2, 4, 6, 8],), 5.0), (([0, 10],), 5.0), (([-3, 3, 6],), 2.0)),
    _f("count_vowels", """
def count_vowels(s):
    n = 0
    for c in s:
        if c in 'aeiou':
            n = n + 1
    return n
""", (("hello",), 2), (("sky",), 0), (("aeiou",), 5), (("banana",), 3), (("",), 0), (("queue",), 4)),
    _f("fizz", """
def fizz(n):
    if n % 15 == 0:
        return 'FizzBuzz'
    if n % 3 == 0:
        return 'Fizz'
    return str(n)
""", ((3,), "Fizz"), ((15,), "FizzBuzz"), ((4,), "4"), ((9,), "Fizz"), ((30,), "FizzBuzz"), ((5,), "5"),
        ((1,), "1")),
    _f("is_leap", """
def is_leap(y):
    if y % 400 == 0:
        return True
    if y % 100 == 0:
        return False
    return y % 4 == 0
""", ((2000,), True), ((1900,), False), ((2024,), True), ((2023,), False), ((2100,), False), ((1600,), True),
        ((2,), False)),
    _f("max3", """
def max3(a, b, c):
    if a >= b and a >= c:
        return a
    if b >= c:
        return b
    return c
""", ((1, 2, 3), 3), ((3, 2, 1), 3), ((1, 5, 2), 5), ((4, 4, 4), 4), ((-1, -5, -3), -1), ((2, 7, 7), 7),
        ((7, 2, 7), 7), ((5, 1, 6), 6)),
    _f("running_sum", """
def running_sum(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out[1:]
""", (([1, 2, 3],), [1, 3, 6]), (([],), []), (([5],), [5]), (([2, -2, 4],), [2, 0, 4]),
        (([1, 1, 1, 1],), [1, 2, 3, 4])),
    _f("factorial", """
def factorial(n):
    p = 1
    for i in range(2, n + 1):
        p = p * i
    return p
""", ((0,), 1), ((1,), 1), ((3,), 6), ((5,), 120), ((4,), 24), ((6,), 720)),
    _f("sum_squares", """
def sum_squares(n):
    s = 0
    for i in range(1, n + 1):
        s = s + i * i
    return s
""", ((1,), 1), ((2,), 5), ((3,), 14), ((0,), 0), ((4,), 30), ((5,), 55)),
    _f("count_even", """
def count_even(xs):
    n = 0
    for x in xs:
        if x % 2 == 0:
            n = n + 1
    return n
""", (([1, 2, 3, 4],), 2), (([],), 0), (([1, 3, 5],), 0), (([0, 2, 8],), 3), (([7, 10],), 1)),
    _f("span", """
def span(xs):
    return max(xs) - min(xs)
""", (([1, 5, 3],), 4), (([7],), 0), (([-2, 2],), 4), (([10, 4, 6],), 6), (([3, 3],), 0)),
    _f("abs_diff", """
def abs_diff(a, b):
    if a > b:
        return a - b
    return b - a
""", ((5, 3), 2), ((3, 5), 2), ((4, 4), 0), ((-1, 2), 3), ((10, 1), 9), ((0, 7), 7)),
    _f("sign", """
def sign(x):
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
""", ((5,), 1), ((-3,), -1), ((0,), 0), ((1,), 1), ((-1,), -1), ((42,), 1)),
    _f("power", """
def power(b, e):
    r = 1
    for _ in range(e):
        r = r * b
    return r
""", ((2, 3), 8), ((3, 2), 9), ((5, 0), 1), ((7, 1), 7), ((2, 5), 32), ((1, 4), 1)),
    _f("reverse", """
def reverse(s):
    out = ''
    for c in s:
        out = c + out
    return out
""", (("abc",), "cba"), (("",), ""), (("a",), "a"), (("hello",), "olleh"), (("ab",), "ba")),
    _f("index_of", """
def index_of(xs, t):
    for i in range(len(xs)):
        if xs[i] == t:
            return i
    return -1
""", (([4, 5, 6], 5), 1), (([4, 5, 6], 4), 0), (([4, 5, 6], 9), -1), (([], 1), -1), (([1, 2, 2], 2), 1),
        (([3, 8], 8), 1)),
    _f("is_sorted", """
def is_sorted(xs):
    for i in range(len(xs) - 1):
        if xs[i] > xs[i + 1]:
            return False
    return True
""", (([1, 2, 3],), True), (([3, 1],), False), (([],), True), (([1, 1, 2],), True), (([1, 3, 2],), False),
        (([2, 1, 3],), False)),
    _f("digit_sum", """
def digit_sum(n):
    s = 0
    for d in str(n):
        s = s + int(d)
    return s
""", ((123,), 6), ((0,), 0), ((9,), 9), ((405,), 9), ((99,), 18), ((1000,), 1)),
    _f("in_range", """
def in_range(x, lo, hi):
    return lo <= x and x < hi
""", ((2, 1, 5), True), ((1, 1, 5), True), ((5, 1, 5), False), ((0, 1, 5), False), ((9, 1, 5), False),
        ((3, 3, 4), True)),
    _f("is_teen", """
def is_teen(n):
    return n >= 13 and n <= 19
""", ((13,), True), ((19,), True), ((15,), True), ((12,), False), ((20,), False), ((5,), False)),
    _f("argmin", """
def argmin(xs):
    best = 0
    for i in range(1, len(xs)):
        if xs[i] < xs[best]:
            best = i
    return best
""", (([3, 1, 2],), 1), (([1, 2, 3],), 0), (([5, 4, 3],), 2), (([2, 2, 1],), 2), (([7],), 0),
        (([4, 1, 1],), 1)),
    _f("dot", """
def dot(a, b):
    s = 0
    for i in range(len(a)):
        s = s + a[i] * b[i]
    return s
""", (([1, 2], [3, 4]), 11), (([], []), 0), (([2], [5]), 10), (([1, 0, 2], [4, 9, 1]), 6),
        (([3, 1], [1, 3]), 6)),
    _f("middle", """
def middle(xs):
    return xs[len(xs) // 2]
""", (([1, 2, 3],), 2), (([5],), 5), (([1, 2, 3, 4],), 3), (([9, 8, 7, 6, 5],), 7), (([4, 6],), 6)),
    _f("celsius", """
def celsius(f):
    return (f - 32) * 5 / 9
""", ((212,), 100.0), ((32,), 0.0), ((50,), 10.0), ((-40,), -40.0), ((59,), 15.0)),
    _f("grade", """
def grade(score):
    if score >= 90:
        return 'A'
    if score >= 70:
        return 'B'
    return 'C'
""", ((95,), "A"), ((90,), "A"), ((89,), "B"), ((70,), "B"), ((69,), "C"), ((10,), "C")),
    _f("triangle_ok", """
def triangle_ok(a, b, c):
    if a + b <= c:
        return False
    return a + c > b and b + c > a
""", ((3, 4, 5), True), ((1, 2, 3), False), ((1, 1, 5), False), ((5, 1, 1), False), ((1, 5, 1), False),
        ((2, 2, 2), True)),
    _f("last_index", """
def last_index(xs, t):
    for i in range(len(xs) - 1, -1, -1):
        if xs[i] == t:
            return i
    return -1
""", (([1, 2, 1], 1), 2), (([1, 2, 3], 1), 0), (([1, 2, 3], 3), 2), (([], 4), -1), (([5, 6], 7), -1)),
    _f("safe_div", """
def safe_div(a, b):
    if b == 0:
        return 0
    return a // b
""", ((7, 2), 3), ((9, 3), 3), ((5, 0), 0), ((0, 4), 0), ((8, 1), 8), ((1, 3), 0)),
)

TEST_ONLY: frozenset[str] = frozenset({"is_leap", "argmin", "grade", "count_vowels", "span", "celsius"})
"""Base functions held out of the train split (the test split uses only these)."""

BY_NAME: dict[str, BaseFunction] = {f.name: f for f in BANK}

_OP_SWAPS: dict[type, tuple[type, ...]] = {
    ast.Add: (ast.Sub,), ast.Sub: (ast.Add,), ast.Mult: (ast.Add,), ast.Div: (ast.FloorDiv,),
    ast.FloorDiv: (ast.Div,), ast.Mod: (ast.FloorDiv,), ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt,),
    ast.Gt: (ast.GtE, ast.Lt), ast.GtE: (ast.Gt,), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
    ast.In: (ast.NotIn,), ast.NotIn: (ast.In,), ast.And: (ast.Or,), ast.Or: (ast.And,),
}
_BUILTIN_SWAPS = {"max": "min", "min": "max"}
_SWAPPABLE_BINOPS = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Add)


def _plus(node: ast.expr, k: int) -> ast.expr:
    return ast.BinOp(copy.deepcopy(node), ast.Add() if k > 0 else ast.Sub(), ast.Constant(abs(k)))


def _node_options(node: ast.AST, ctx: dict[str, Any]) -> list[tuple[str, ast.AST]]:
    """Replacements for ``node`` as ``(kind, new_node)``; ``ctx`` holds the function's names."""
    out: list[tuple[str, ast.AST]] = []
    literal = _int_literal(node)
    if id(node) in ctx["signed"]:
        pass  # the constant under a unary minus: mutated as the signed literal instead
    elif literal is not None or isinstance(node, ast.Constant):
        out.extend(_constant_options(node.value if literal is None else literal, ctx["constants"]))
    elif isinstance(node, (ast.BinOp, ast.BoolOp)):
        for op in _OP_SWAPS.get(type(node.op), ()):
            new = copy.deepcopy(node)
            new.op = op()
            out.append(("wrong_operator", new))
        if isinstance(node, ast.BinOp) and isinstance(node.op, _SWAPPABLE_BINOPS):
            out.append(("swapped_args", ast.BinOp(node.right, node.op, node.left)))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1:
        for op in _OP_SWAPS.get(type(node.ops[0]), ()):
            out.append(("wrong_operator", ast.Compare(node.left, [op()], node.comparators)))
        out.append(("swapped_args", ast.Compare(node.comparators[0], node.ops, [node.left])))
    elif isinstance(node, ast.Call) and len(node.args) >= 2:
        args = [node.args[1], node.args[0], *node.args[2:]]
        out.append(("swapped_args", ast.Call(node.func, args, node.keywords)))
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in ctx["variables"]:
        kind = "wrong_return" if node in ctx["return_values"] else "wrong_variable"
        out.extend((kind, ast.Name(v, ast.Load())) for v in ctx["variables"] if v != node.id)
    elif isinstance(node, ast.Name) and node.id in _BUILTIN_SWAPS:
        out.append(("wrong_variable", ast.Name(_BUILTIN_SWAPS[node.id], ast.Load())))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        i = 0 if len(node.args) == 1 else 1
        # a literal bound is already moved by the constant ±1 above
        for k in (1, -1) if _int_literal(node.args[i]) is None else ():
            args = list(node.args)
            args[i] = _plus(args[i], k)
            out.append(("off_by_one", ast.Call(node.func, args, [])))
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, (ast.Constant, ast.Slice)):
        for k in (1, -1):
            out.append(("off_by_one", ast.Subscript(node.value, _plus(node.slice, k), node.ctx)))
    return out


def _int_literal(node: ast.AST) -> int | None:
    """The value of an int literal, ``-1`` (a unary minus on a constant) included; else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_literal(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _constant_options(value: Any, constants: list[Any]) -> list[tuple[str, ast.AST]]:
    if isinstance(value, bool):
        return [("wrong_constant", ast.Constant(not value))]
    if isinstance(value, int):
        out = [("off_by_one", ast.Constant(value + k)) for k in (1, -1)]
        others = [c for c in constants if type(c) is int and c not in (value, value + 1, value - 1)]
        return out + [("wrong_constant", ast.Constant(c)) for c in others]
    if isinstance(value, str):
        others = [c for c in constants if type(c) is str and c != value]
        if not others and len(value) > 1:
            others = [value[:-1]]
        return [("wrong_constant", ast.Constant(c)) for c in others]
    return []


def _context(fn: ast.FunctionDef) -> dict[str, Any]:
    variables = [a.arg for a in fn.args.args]
    constants: list[Any] = []
    returns: list[ast.AST] = []
    signed: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.UnaryOp) and _int_literal(node) is not None:
            signed.add(id(node.operand))
            constants.append(_int_literal(node))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in variables:
            if node.id != "_":
                variables.append(node.id)
        elif isinstance(node, ast.Constant) and id(node) not in signed and node.value not in constants:
            constants.append(node.value)
        elif isinstance(node, ast.Return) and node.value is not None:
            returns.append(node.value)
    return {"variables": variables, "constants": list(dict.fromkeys(constants)), "return_values": returns,
            "signed": signed}


def _replace(tree: ast.AST, target: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is target for v in value):
                value[next(i for i, v in enumerate(value) if v is target)] = new
                return
    raise AssertionError("mutation target not found in tree")


def mutants(func: BaseFunction) -> list[Mutant]:
    """Every distinct single-line, parseable bug of ``func`` (not yet checked against tests)."""
    ref_lines = func.source.splitlines()
    tree = pyast.parse(func.source)
    if ast.unparse(tree) != func.source:
        raise ValueError(f"bank function {func.name!r} is not in canonical ast.unparse form")
    fn = tree.body[0]
    ctx = _context(fn)
    seen: set[tuple[int, str]] = set()
    out: list[Mutant] = []
    for idx, node in enumerate(ast.walk(tree)):
        if node is fn or isinstance(node, ast.arguments) or getattr(node, "lineno", 1) == 1:
            continue
        for kind, new in _node_options(node, ctx):
            mutated = copy.deepcopy(tree)  # walks in the same order: node idx is the copy of `node`
            target = next(itertools.islice(ast.walk(mutated), idx, None))
            _replace(mutated, target, copy.deepcopy(new))
            lines = ast.unparse(ast.fix_missing_locations(mutated)).splitlines()
            diff = [i for i, (a, b) in enumerate(zip(lines, ref_lines)) if a != b]
            if len(lines) != len(ref_lines) or len(diff) != 1:
                continue
            line = diff[0]
            if (line, lines[line]) in seen:
                continue
            seen.add((line, lines[line]))
            out.append(Mutant(func.name, kind, line + 1, lines[line], ref_lines[line]))
    return out
