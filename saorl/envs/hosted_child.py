"""The child process of :mod:`saorl.envs.hosted`: one env's ``reset`` / ``step`` calls, one at a time.

Started as ``python -c BOOT SYS_PATH FD PARENT_PID ROLE`` (:data:`BOOT`; ROLE names it in ``ps``:
:mod:`saorl.proctitle`): with the parent's ``sys.path``,
so it imports what the parent can (the env's module, the reward function's), and the fd of its end
of a socket pair. It dies with its parent (:func:`saorl.parent_death.die_with_parent`, whose
kernel parent-death signal also ends a child stuck in code that never yields) and exits when the
parent closes the socket. Frames are pickled, in ``multiprocessing.connection``'s framing::

    parent: (cls, options)                   child: ("ready", None) | ("error", text)
    parent: (state | None, method, args)     child: ("ok", result, state) | ("raise", exc, traceback)

The first frame builds one ``cls(**options)``, so the imports it needs happen before any call's
deadline starts. ``state`` is the env pickled after the previous call of its episode (None: a fresh
``cls(**options)``, for ``reset``); the child sends the env back pickled after every call, so any
child can serve an episode's next call.
"""

from __future__ import annotations

import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "from saorl.envs.hosted_child import main; main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])")

_STATE_HINT = ("an env whose calls run under env.call_timeout_s crosses a process boundary with every "
               "call: keep its state and its return values picklable (no open files, sockets, locks or "
               "lambdas), or set env.call_timeout_s=null to run it in the worker, without a deadline")


def main(fd: int, parent_pid: int, role: str = "env host") -> None:
    from saorl.parent_death import die_with_parent
    from saorl.proctitle import set_title

    die_with_parent(parent_pid, kernel_signal=True)
    set_title(role)  # what ps shows: saorl: reward host 3 of run NAME
    conn = Connection(fd)
    try:
        cls, options = pickle.loads(conn.recv_bytes())
        cls(**options)
    except EOFError:
        return
    except BaseException as e:  # an import that fails, an __init__ that raises
        conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(answer(cls, options, frame))


def answer(cls: type, options: dict[str, Any], frame: bytes) -> bytes:
    """The reply frame to one call frame (see the module docstring)."""
    try:
        state, method, args = pickle.loads(frame)
        env = cls(**options) if state is None else pickle.loads(state)
        result = getattr(env, method)(*args)
    except BaseException as e:  # user code's SystemExit and KeyboardInterrupt are its errors too
        return pickle.dumps(("raise", _portable(e), traceback.format_exc()))
    try:
        return pickle.dumps(("ok", result, pickle.dumps(env)))
    except Exception as e:
        err = TypeError(f"{method} returned, but its result or the env's state does not pickle "
                        f"({type(e).__name__}: {e}); {_STATE_HINT}")
        return pickle.dumps(("raise", err, traceback.format_exc()))


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (most exceptions do), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
