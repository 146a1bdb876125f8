"""Thread-safe :func:`ast.parse` and :func:`ast.literal_eval` for envs that read model-written code.

CPython 3.11 (up to 3.11.x releases that carry the fix of gh-106905) counts the recursion depth of
the C-to-Python AST conversion in state shared by every thread. Two threads parsing at the same
time, with a garbage collection that runs a Python finaliser (and so lets the other thread in) in
the middle of a conversion, end with ``SystemError: AST constructor recursion depth mismatch`` on a
perfectly valid input. saorl's runtime steps envs in worker threads, so the built-in envs parse
through this module: every parse holds one process-wide lock, and a mismatch raised anyway (a
parse outside saorl, in a user's env or reward, raced with ours) is retried a few times before it
is allowed to escape.

CPython 3.11's :mod:`traceback` parses source lines with :func:`ast.parse` too (to place its
``^~~~`` marks), so a traceback formatted while envs step races the same way: :func:`format_exc`
formats under the lock, and a formatting failure leaves the exception's own line instead of
raising out of an ``except`` block (where it would lose the error being reported).

``PARSE_ERRORS`` are the exceptions a parse of hostile text may raise (bad syntax, null bytes,
nesting beyond the parser's limit, inputs too large); callers turn them into an observation.
"""

from __future__ import annotations

import ast
import threading
import traceback
from typing import Any

PARSE_ERRORS: tuple[type[BaseException], ...] = (SyntaxError, ValueError, RecursionError, MemoryError)
RETRIES = 3
_MISMATCH = "AST constructor recursion depth mismatch"
_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """:func:`ast.parse` under the process-wide lock; a raced depth mismatch is retried."""
    for attempt in range(RETRIES + 1):
        try:
            with _LOCK:
                return ast.parse(source, mode=mode)
        except SystemError as e:
            if _MISMATCH not in str(e) or attempt == RETRIES:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def literal_eval(text: str) -> Any:
    """:func:`ast.literal_eval` of ``text``, parsed through :func:`parse` (evaluating the tree
    builds no AST, so only the parse needs the lock)."""
    return ast.literal_eval(parse(text.lstrip(" \t"), mode="eval"))


def format_exc() -> str:
    """:func:`traceback.format_exc` under the lock; on a failure to format, a one-line note."""
    try:
        with _LOCK:
            return traceback.format_exc()
    except Exception as e:  # the traceback is a courtesy; the error it describes must still go out
        return f"(traceback not formatted: {type(e).__name__}: {e})\n"
