"""Env calls under a deadline: user code runs in warm child processes that are killed past it.

A call that never returns — a busy loop, a C call that holds the GIL, a sleep — cannot be stopped
from inside the process that made it: no thread can be killed, no cooperative check runs. So for an
env that runs user code (a reward function, an env class from outside saorl), :class:`HostedEnv`
runs ``reset`` and ``step`` in a child process (:mod:`saorl.envs.hosted_child`) and waits at most
``timeout_s`` for the answer. Past it, the child's process group is SIGKILLed — the sandbox's way
with model-written code (:func:`saorl.envs.sandbox.kill_group`: a child of its own session, the
deadline kept by the parent, the whole group killed) — and :class:`CallTimeout` says what ran
(:meth:`~saorl.envs.base.Env.call_site`: the reward function and the task's row) and the deadline.

Children are warm: a :class:`HostPool` keeps the idle ones and starts one only when every child is
busy, or to replace one that was killed. No child belongs to an episode: the env's state travels
with each call (pickled both ways), so an episode holds no child between its calls, the pool holds
at most as many children as there are calls at once (not episodes), and a killed child takes only
the call that ran past its deadline with it. What a call costs on top of running in-process:
``benchmarks/bench_env_calls.py`` (docs/performance.md).

A child's start is mostly the imports of the env's module (seconds of CPU for one that imports
torch), so at most :data:`STARTS_AT_ONCE` children start at once (one per CPU core): a call that
finds every child busy and that many starting waits for the first child to come free or for a
start slot of its own, whichever comes first. Sixteen calls at once on a cold pool are then served
by the first few children, instead of sixteen children that share the cores, all start together
and all finish late.

What a child starts outside its process group (a ``setsid``) is killed by the mark in its
environment (:mod:`saorl.envs.escapees`): one child's on its deadline, every child's when the pool
closes.

Children are started from one long-lived thread of the pool: the kernel's parent-death signal,
which ends a child stuck where nothing else can reach it once its parent is gone, follows the
thread that started it (see :mod:`saorl.runtime.backends.lifeline`).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from saorl.envs.base import Env, Progress, Split, StepResult, Task
from saorl.envs.escapees import MARK, kill_marked, run_mark
from saorl.envs.hosted_child import BOOT
from saorl.envs.sandbox import kill_group

_POOLS = itertools.count()

HOST_START_TIMEOUT_S = 120.0
"""Seconds a new child may take to start and build one env (imports included) before it is given
up; not part of any call's deadline."""

STARTS_AT_ONCE = max(2, os.cpu_count() or 1)
"""Children a pool starts at once at most (see the module docstring)."""


class CallTimeout(TimeoutError):
    """A call into user code ran past its deadline; its process was killed."""


class HostDied(RuntimeError):
    """The child process running a call died (or could not start, or its pool was closed)."""


def child_traceback(error: BaseException) -> str | None:
    """The traceback, in the child that ran it, of the call whose exception ``error`` is or
    wraps (``__cause__`` / ``__context__``); None if no hosted call raised it."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = getattr(e, "child_traceback", None)
        if isinstance(text, str):
            return text
        e = e.__cause__ or e.__context__
    return None


class _Host:
    """One child process and its end of the socket pair; ``mark``: its environment's mark
    (:mod:`saorl.envs.escapees`), which whatever it starts inherits."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, mark: str) -> None:
        self.proc, self.conn, self.mark = proc, conn, mark
        self._code: int | None = None
        self._killed = False
        self._lock = threading.Lock()  # a call's thread and close() may both end it

    def handshake(self, preload: bytes, what: str) -> None:
        try:
            self.conn.send_bytes(preload)
            ready = self.conn.poll(HOST_START_TIMEOUT_S)
            reply = self.conn.recv_bytes() if ready else None
        except (EOFError, OSError):  # OSError: it died with our frame unread (a reset), or close() ran
            raise HostDied(f"the process for {what} died while starting (exit code {self.kill()})") from None
        if reply is None:
            self.kill()
            raise HostDied(f"the process for {what} did not start within {HOST_START_TIMEOUT_S:g} s")
        kind, text = pickle.loads(reply)
        if kind != "ready":
            self.kill()
            raise HostDied(f"the process for {what} could not build it: {text}")

    def call(self, frame: bytes, timeout_s: float, site: str) -> tuple:
        """The reply to ``frame``; the child is killed (and the error raised) on a timeout or its death."""
        try:
            self.conn.send_bytes(frame)
            ready = self.conn.poll(timeout_s)
            reply = self.conn.recv_bytes() if ready else None
        except (EOFError, OSError):
            raise HostDied(f"{site}: the process running it died (exit code {self.kill()})") from None
        except BaseException:  # KeyboardInterrupt: the child's answer would be read by the next call
            self.kill()
            raise
        if reply is None:
            self.kill()
            raise CallTimeout(f"{site} did not return within {timeout_s:g} s (env.call_timeout_s); its "
                              "process was killed")
        return pickle.loads(reply)

    def kill(self, close: bool = True, escapees: bool = True) -> int | None:
        """Kill the child's process group and reap it, once (a reaped pid may name another process
        later); its exit code. ``close=False`` leaves our end of the socket open for a call that
        another thread is waiting in: it reads the end of the stream and closes it. ``escapees``:
        also what it started outside its group (a ``setsid``), found by its mark."""
        with self._lock:
            if not self._killed:
                self._killed = True
                kill_group(self.proc)
                if escapees:
                    kill_marked(self.mark)
                try:
                    self._code = self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL of a live process
                    pass
            if close:
                self.conn.close()
        return self._code


class HostPool:
    """Warm children that run calls on envs of ``cls(**options)``, one call at a time each."""

    def __init__(self, cls: type[Env], options: dict[str, Any], starts_at_once: int = STARTS_AT_ONCE) -> None:
        if starts_at_once < 1:
            raise ValueError(f"starts_at_once must be at least 1, got {starts_at_once}")
        self.what = f"env {cls.__module__}:{cls.__qualname__}"
        self.role = "reward host" if getattr(cls, "name", None) == "prompt_reward" else "env host"
        """What ``ps`` calls its children (:mod:`saorl.proctitle`), numbered as they start."""
        try:
            self._preload = pickle.dumps((cls, options))
            pickle.loads(self._preload)
        except Exception as e:
            raise ValueError(f"{self.what} runs user code, so its calls run in a separate process "
                             f"(env.call_timeout_s), which needs the class importable by its name and "
                             f"the options picklable: {type(e).__name__}: {e}. Define the class at the "
                             "top level of a module, or set env.call_timeout_s=null to run it in the "
                             "worker without a deadline") from None
        self._idle: list[_Host] = []
        self._live: set[_Host] = set()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        """Notified when a child comes free (idle), a start ends or the pool closes."""
        self._starts_at_once = starts_at_once
        self._starting = 0
        self._closed = False
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="saorl-env-host")
        self.mark = f"{run_mark()}/{os.getpid()}.{next(_POOLS)}"
        """The prefix of its children's marks (:mod:`saorl.envs.escapees`)."""
        self.started = 0
        """Children started so far (replacements of killed ones included)."""

    def call(self, state: bytes | None, method: str, args: tuple, timeout_s: float,
             site: str) -> tuple[Any, bytes]:
        """``(result, state after the call)`` of ``method(*args)`` on the env ``state`` holds (a fresh
        one when None), run in a child; raises what the call raised, :class:`CallTimeout` past
        ``timeout_s`` (the child is killed) or :class:`HostDied`."""
        frame = pickle.dumps((state, method, args))
        host = self._take()
        try:
            reply = host.call(frame, timeout_s, site)
        except BaseException:
            self._drop(host)
            raise
        self._give(host)
        if reply[0] == "ok":
            return reply[1], reply[2]
        exc = reply[1]
        exc.child_traceback = reply[2]  # where user code failed, for logs (child_traceback())
        raise exc

    def _take(self) -> _Host:
        """An idle child, else one this call starts, else (``starts_at_once`` starting) the first of
        the two that comes: a child come free, or a start of its own; waited for at most
        :data:`HOST_START_TIMEOUT_S`, as a start is (an ``__init__`` that hangs fails every call
        in that time, not one start slot after another)."""
        deadline = time.monotonic() + HOST_START_TIMEOUT_S
        with self._freed:
            while True:
                if self._closed:
                    raise HostDied(f"the processes for {self.what} were closed (the run is stopping)")
                if self._idle:
                    return self._idle.pop()
                if self._starting < self._starts_at_once:
                    self._starting += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HostDied(f"no process for {self.what} came free or could start within "
                                   f"{HOST_START_TIMEOUT_S:g} s ({self._starting} starting)")
                self._freed.wait(left)
        try:
            return self._start_one()
        finally:
            with self._freed:
                self._starting -= 1
                self._freed.notify_all()

    def _start_one(self) -> _Host:
        try:
            host = self._starter.submit(self._start).result()  # started from the pool's own thread
        except RuntimeError as e:  # the starter was shut down: close() ran meanwhile
            raise HostDied(f"the processes for {self.what} were closed (the run is stopping)") from e
        try:
            host.handshake(self._preload, self.what)
        except BaseException:
            self._drop(host)
            raise
        return host

    def _start(self) -> _Host:
        ours, theirs = socket.socketpair()
        with self._lock:
            mark = f"{self.mark}/{self.started}"
            role = f"{self.role} {self.started}"
            self.started += 1
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, json.dumps(sys.path), str(theirs.fileno()), str(os.getpid()),
                 role],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, MARK: mark})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        host = _Host(proc, Connection(ours.detach()), mark)
        with self._lock:
            self._live.add(host)
            closed = self._closed
        if closed:  # close() ran while this one started
            self._drop(host)
            raise HostDied(f"the processes for {self.what} were closed (the run is stopping)")
        return host

    def _give(self, host: _Host) -> None:
        with self._freed:
            if not self._closed:
                self._idle.append(host)
                self._freed.notify_all()
                return
        self._drop(host)

    def _drop(self, host: _Host) -> None:
        with self._lock:
            self._live.discard(host)
            if host in self._idle:
                self._idle.remove(host)
        host.kill()

    def pids(self) -> list[int]:
        """The process ids of the live children (idle and busy)."""
        with self._lock:
            return [h.proc.pid for h in self._live]

    def close(self) -> None:
        """Kill every child, busy ones too (their calls raise :class:`HostDied`); later calls fail."""
        with self._freed:
            self._closed = True
            hosts, idle = list(self._live), set(self._idle)
            self._live.clear()
            self._idle.clear()
            self._freed.notify_all()  # the calls waiting for a child raise HostDied
        for host in hosts:
            host.kill(close=host in idle, escapees=False)
        kill_marked(self.mark)  # what any child started outside its group, in one pass
        self._starter.shutdown(wait=False)


class HostedEnv(Env):
    """An env whose ``reset`` and ``step`` run in a :class:`HostPool`'s child, under ``timeout_s``.

    ``template`` is an instance of the env, built in this process: it gives the attributes the
    agent loop reads (``name``, ``stop_strings``, ``max_turns``, ``observation_format``,
    ``observation_role``), :meth:`call_site` for messages,
    and runs ``generate_tasks`` and ``demonstration`` (which take everything they need as
    arguments). Each episode's env is built in a child by ``reset``.
    """

    def __init__(self, template: Env, pool: HostPool, timeout_s: float) -> None:
        self.template, self.pool, self.timeout_s = template, pool, float(timeout_s)
        self.name = template.name  # type: ignore[misc]  # the template's, per instance
        self.stop_strings = template.stop_strings  # type: ignore[misc]
        self.max_turns = template.max_turns
        self.observation_format = template.observation_format
        self.observation_role = template.observation_role
        self.tools = template.tools
        self._state: bytes | None = None
        self._task: Task | None = None
        self._action_ids: list[int] | None = None
        self._completion: list[dict[str, Any]] | None = None
        self.call_s = 0.0
        """Seconds spent in calls, round trips included (what benchmarks read)."""

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        return self.template.generate_tasks(split, n, seed)

    def demonstration(self, task: Task, rng) -> list[str]:
        return self.template.demonstration(task, rng)

    def call_site(self, method: str, task: Task) -> str:
        return self.template.call_site(method, task)

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        self._task = task
        return self._call(None, "reset", (task, progress))

    def note_action_ids(self, ids: list[int]) -> None:
        """Handed to the env in the child with the step (one more round trip, only when given)."""
        self._action_ids = list(ids)

    def note_completion(self, messages: list[dict[str, Any]]) -> None:
        """Handed to the env in the child with the step, like :meth:`note_action_ids`."""
        self._completion = list(messages)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError(f"{type(self.template).__name__}.step called before reset")
        ids, self._action_ids = self._action_ids, None
        if ids is not None and type(self.template).note_action_ids is not Env.note_action_ids:
            self._call(self._state, "note_action_ids", (ids,))
        completion, self._completion = self._completion, None
        if completion is not None and type(self.template).note_completion is not Env.note_completion:
            self._call(self._state, "note_completion", (completion,))
        return self._call(self._state, "step", (action,))

    def _call(self, state: bytes | None, method: str, args: tuple) -> Any:
        t0 = time.perf_counter()
        try:
            result, self._state = self.pool.call(state, method, args, self.timeout_s,
                                                 self.call_site(method, self._task))
        finally:
            self.call_s += time.perf_counter() - t0
        return result
