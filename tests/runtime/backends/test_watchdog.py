"""The stall watchdog tells slow from stalled (saorl.runtime.backends.watchdog): the limit logic on a
fake clock, then real worker processes — one that sends nothing for seconds while it works (its
event loop busy building an env) is never restarted, one stopped by SIGSTOP is, within its limit."""

import os
import signal
import time

import pytest

from saorl.config import load_config
from saorl.data.task import Task
from saorl.models.codec import TokenizerSpec
from saorl.runtime.backends.local import LocalBackend
from saorl.runtime.backends.messages import RolloutRequest
from saorl.runtime.backends.watchdog import GAP_FACTOR, StallWatch, process_cpu_s
from saorl.runtime.parts import worker_spec

# ------------------------------------------------------------------ the limit, on a fake clock


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _watch(stall_s=10.0, load=1.0):
    clock = Clock()
    w = StallWatch(1, stall_s, load=lambda: load, clock=clock)
    w.watch(0)
    return w, clock


def _run(w, clock, samples, dt=1.0):
    """Feed (counters, cpu) each ``dt`` seconds; the first stall reported, as (time, idle), or None."""
    for sample, cpu in samples:
        clock.t += dt
        idle = w.stalled(0, sample, cpu)
        if idle is not None:
            return clock.t, idle
    return None


def test_no_progress_past_the_limit_is_a_stall_and_any_progress_is_not():
    w, clock = _watch(stall_s=10.0)
    assert _run(w, clock, [((5, 5), 1.0)] * 10) is None  # 10 s without progress: within the limit
    assert _run(w, clock, [((5, 5), 1.0)] * 3) == (11.0, 11.0)
    for moving in ([((n, 5), 1.0) for n in range(60)], [((5, n), 1.0) for n in range(60)],
                   [((5, 5), 1.0 + 0.5 * n) for n in range(60)]):  # tokens, calls, or CPU alone
        w, clock = _watch(stall_s=10.0)
        assert _run(w, clock, moving) is None


def test_a_trickle_of_cpu_is_not_progress():
    """A stopped or deadlocked worker's pulse thread uses a few µs a second: below 1% of a core."""
    w, clock = _watch(stall_s=10.0)
    got = _run(w, clock, [((5, 5), 1.0 + 0.0005 * n) for n in range(30)])
    assert got is not None and got[1] > 10.0


def test_the_limit_grows_with_the_longest_measured_gap_and_the_load():
    w, clock = _watch(stall_s=10.0)
    still = [((1, 1), 1.0)] * 8
    assert _run(w, clock, [*still, ((2, 1), 1.0)]) is None  # a gap of 9 s, come out of by itself
    assert w.limit(0) == GAP_FACTOR * 9.0 == 27.0
    assert _run(w, clock, [((2, 1), 1.0)] * 30) == (9.0 + 28.0, 28.0)
    w, clock = _watch(stall_s=10.0, load=4.0)  # load 4 per core: 40 s
    assert _run(w, clock, [((1, 1), 1.0)] * 41)[1] == 41.0


def test_a_stretch_the_watch_did_not_see_measures_no_gap():
    """The trainer busy for 60 s with a step: the worker's progress in between is not a 60-s gap."""
    w, clock = _watch(stall_s=10.0)
    _run(w, clock, [((1, 1), 1.0)])
    clock.t += 60.0
    assert w.stalled(0, (2, 1), 1.0) is None and w.limit(0) == 10.0


def test_cpu_seconds_of_this_process_are_read_from_proc():
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc here")
    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.15
    assert process_cpu_s(2**22 + 12345) is None


# ------------------------------------------------------------------ real worker processes
TASK = Task("t/arith", {"family": "arith", "expr": "1+2", "answer": 3})


def _backend(tmp_path, setup_s: float) -> LocalBackend:
    cfg = load_config(None, ["model.policy=tiny-moe", "env.type=slow_setup_env:SlowSetupEnv",
                             f"env.options.setup_s={setup_s}", "env.options.max_turns=1",
                             "rollout.max_new_tokens=8",
                             "rollout.max_total_tokens=80", "env.call_timeout_s=null"])
    spec = worker_spec(cfg, tmp_path, "tiny-moe", TokenizerSpec(None).load())
    backend = LocalBackend(spec, num_workers=1, concurrency=2, stall_s=1.0)
    backend.start()
    deadline = time.monotonic() + 60
    while not backend.ready():
        assert time.monotonic() < deadline, "the worker never became ready"
        backend.poll(0.1)
    return backend


@pytest.mark.slow
def test_a_worker_silent_for_seconds_while_it_works_is_not_restarted(tmp_path):
    """Each episode's env keeps the worker's event loop busy for 1.5 s: no message for longer than
    runtime.worker_stall_s (1 s) — a heartbeat watchdog killed it — but CPU is used all along."""
    backend = _backend(tmp_path, setup_s=1.5)
    try:
        pid = backend.pids()[0]
        for rid in range(2):  # no weights published: the ones it started with
            backend.submit(RolloutRequest(rid, TASK, min_version=-1))
        finished, errors, deadline = [], [], time.monotonic() + 60
        while len(finished) < 2 and time.monotonic() < deadline:
            out = backend.poll(0.1)
            finished += out.finished
            errors += out.errors
        assert backend.restarts == 0 and not errors, errors
        assert sorted(t.episode.rid for t in finished) == [0, 1] and backend.pids() == [pid]
    finally:
        backend.shutdown()


@pytest.mark.slow
def test_a_stopped_worker_is_restarted_within_its_limit(tmp_path):
    backend = _backend(tmp_path, setup_s=0.0)
    pid = backend.pids()[0]
    try:
        backend.submit(RolloutRequest(0, TASK, min_version=-1))
        os.kill(pid, signal.SIGSTOP)
        t0, errors, lost = time.monotonic(), [], []
        limit = backend.watch.limit(0)
        while backend.restarts == 0 and time.monotonic() - t0 < limit + 10:
            out = backend.poll(0.1)
            errors += out.errors
            lost += out.lost
        took = time.monotonic() - t0
        assert backend.restarts == 1, (took, limit, errors)
        assert took < limit + 5, (took, limit)
        assert lost == [0]  # its rollout re-queued
        (msg,) = errors
        assert msg.startswith("rollout worker 0 made no progress for") and "runtime.worker_stall_s=1" in msg
        assert "killed; restarted, 1 rollouts re-queued" in msg
        assert backend.pids()[0] != pid
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        backend.shutdown()
