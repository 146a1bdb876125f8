"""How a HostPool starts its children (saorl.envs.hosted): calls at once on a cold pool, at most
``starts_at_once`` children starting, starts that fail. Real child processes."""

import sys
import threading
import time

import pytest

from saorl.envs.hosted import HostDied, HostPool

from .procs import gone

USER_CODE = '''
import os, time

from saorl.envs.base import Env, StepResult

class Gated(Env):
    """Its __init__ (run in each new child before its first call) waits for the gate file."""
    name = "gated"

    def __init__(self, gate):
        while not os.path.exists(gate):
            time.sleep(0.02)

    def generate_tasks(self, split, n, seed):
        return []

    def reset(self, task, progress=None):
        self.pid = os.getpid()
        return "go"

    def step(self, action):
        return StepResult(str(self.pid), float(len(action)), True, {})

class Broken(Gated):
    def __init__(self, gate):
        raise ValueError("no such device: " + gate)

class Dies(Gated):
    def __init__(self, gate):
        os._exit(3)
'''


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "hosted_start_code.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the children get this sys.path
    sys.modules.pop("hosted_start_code", None)
    import hosted_start_code

    return hosted_start_code


def _episode(pool: HostPool, action: str) -> tuple[float, int]:
    """reset, then step with ``action`` (the state travels between them): (reward, the child's pid)."""
    obs, state = pool.call(None, "reset", (None,), 30.0, "reset")
    assert obs == "go"
    result, _ = pool.call(state, "step", (action,), 30.0, "step")
    return result.reward, int(result.observation)


def _at_once(n: int, fn) -> tuple[list[threading.Thread], dict[int, object]]:
    out: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:  # handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, out


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 30.0
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_calls_at_once_on_a_cold_pool_wait_for_the_starts_in_flight_and_all_answer(user_code, tmp_path):
    gate = tmp_path / "gate"
    pool = HostPool(user_code.Gated, {"gate": str(gate)}, starts_at_once=2)
    try:
        threads, out = _at_once(8, lambda i: _episode(pool, "x" * (i + 1)))
        _wait_for(lambda: len(pool.pids()) == 2, "two children starting")
        time.sleep(0.5)  # room for the other six calls to start children of their own, were they let
        assert (pool.started, len(pool.pids()), out) == (2, 2, {})  # they wait: nothing answered yet
        gate.touch()
        for t in threads:
            t.join(60.0)
        assert sorted(out) == list(range(8))
        assert [out[i][0] for i in range(8)] == [float(i + 1) for i in range(8)]  # each its own answer
        served_by = {out[i][1] for i in range(8)}
        assert served_by <= set(pool.pids()) and 2 <= pool.started <= 8
        assert len(served_by) <= pool.started
    finally:
        pids = pool.pids()
        pool.close()
    assert pids and all(gone(p) for p in pids)


def test_each_call_gets_the_clear_error_of_a_child_that_cannot_build_the_env(user_code):
    pool = HostPool(user_code.Broken, {"gate": "/dev/gpu9"}, starts_at_once=1)
    threads, out = _at_once(4, lambda i: _episode(pool, "x"))
    for t in threads:
        t.join(60.0)
    assert len(out) == 4 and all(isinstance(e, HostDied) for e in out.values()), out
    msg = ("the process for env hosted_start_code:Broken could not build it: "
           "ValueError: no such device: /dev/gpu9")
    assert {str(e) for e in out.values()} == {msg}
    assert pool.started == 4 and pool.pids() == []  # each call's own start, each child gone
    pool.close()


def test_a_child_that_dies_while_starting_names_its_exit_code(user_code):
    with pytest.raises(HostDied, match=r"env hosted_start_code:Dies died while starting \(exit code 3\)"):
        HostPool(user_code.Dies, {"gate": ""}).call(None, "reset", (None,), 30.0, "reset")


def test_calls_waiting_behind_a_start_that_hangs_fail_within_the_start_timeout(user_code, tmp_path,
                                                                                monkeypatch):
    import saorl.envs.hosted as hosted

    monkeypatch.setattr(hosted, "HOST_START_TIMEOUT_S", 1.0)
    pool = HostPool(user_code.Gated, {"gate": str(tmp_path / "never")}, starts_at_once=1)
    threads, out = _at_once(3, lambda i: _episode(pool, "x"))
    for t in threads:
        t.join(30.0)  # each gives up after 1 s of its own waiting or its own start: 2 s at most
    assert len(out) == 3 and all(isinstance(e, HostDied) for e in out.values()), out
    started = "the process for env hosted_start_code:Gated did not start within 1 s"
    waited = "no process for env hosted_start_code:Gated came free or could start within 1 s (1 starting)"
    # the first call's own start times out; a call behind it waits no longer than that, not for a
    # start slot and then a whole start of its own (one slot: the third cannot have had both)
    assert {str(e) for e in out.values()} == {started, waited}
    assert pool.pids() == []
    pool.close()


def test_close_ends_the_calls_that_wait_for_a_child(user_code, tmp_path):
    pool = HostPool(user_code.Gated, {"gate": str(tmp_path / "never")}, starts_at_once=1)
    threads, out = _at_once(3, lambda i: _episode(pool, "x"))
    _wait_for(lambda: len(pool.pids()) == 1, "one child starting")
    (pid,) = pool.pids()
    pool.close()
    for t in threads:
        t.join(10.0)
    assert not any(t.is_alive() for t in threads)
    assert len(out) == 3 and all(isinstance(e, HostDied) for e in out.values()), out
    assert sum("were closed" in str(e) for e in out.values()) >= 2  # the waiting ones
    assert gone(pid) and pool.started == 1


def test_starts_at_once_must_be_positive(user_code):
    with pytest.raises(ValueError, match="starts_at_once must be at least 1, got 0"):
        HostPool(user_code.Gated, {"gate": ""}, starts_at_once=0)
