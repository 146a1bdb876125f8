"""How a run ends (Run._finish): end.json's ``why`` and a failure to write it, on a Run whose
parts are stand-ins (no model, no workers)."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest

from saorl.runtime.memory import MemoryWatch
from saorl.runtime.run import Run


class _Recorder:
    def __init__(self, ended_error: OSError | None = None):
        self.lines, self.ends, self.closed = [], [], False
        self.ended_error = ended_error

    def message(self, text):
        self.lines.append(text)

    def ended(self, info):
        if self.ended_error is not None:
            raise self.ended_error
        self.ends.append(info)

    def export_final(self, *models):
        pass

    def close(self):
        self.closed = True


def _run(tmp_path, recorder, *, step=0, steps=5, expired=False) -> Run:
    run = Run.__new__(Run)
    noop = SimpleNamespace(stop=lambda: None, shutdown=lambda: None, close=lambda: None)
    run.feed, run.journal, run.recorder = noop, noop, recorder
    run.parts = SimpleNamespace(backend=noop, weights=noop)
    run.step, run._checkpointed_step = step, step
    run.settings = SimpleNamespace(steps=steps)
    run.clock = SimpleNamespace(expired=lambda: expired)
    run.stop = SimpleNamespace(requested=False)
    run.learner = SimpleNamespace(full_models=lambda: (), version=0)
    run.paths = SimpleNamespace(root=tmp_path)
    run.observer = SimpleNamespace(run_finished=lambda: None)
    run.memory, run._own_memory = MemoryWatch(), True
    return run


def test_end_json_that_cannot_be_written_keeps_the_run_s_own_outcome(tmp_path):
    recorder = _Recorder(OSError(errno.ENOSPC, "No space left on device"))
    run = _run(tmp_path, recorder)
    with pytest.raises(RuntimeError, match="the run's own failure"):
        try:
            raise RuntimeError("the run's own failure")
        finally:
            run._finish()
    assert recorder.closed
    assert "end.json not written: OSError: [Errno 28] No space left on device" in recorder.lines
    run._finish()  # no exception of its own: the run's outcome (none) is kept too


def test_an_exception_ends_the_run_as_failed_whatever_its_steps_or_budget_say(tmp_path):
    recorder = _Recorder()
    run = _run(tmp_path, recorder, expired=True)  # raised after the budget expired: not "budget"
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a step failed")
        finally:
            run._finish(failed=True)

    def export_fails(*models):
        raise OSError(errno.EIO, "Input/output error")

    recorder.export_final = export_fails
    done = _run(tmp_path, recorder, step=5, steps=5)  # every step trained, the final policy not written
    with pytest.raises(OSError):
        done._finish()
    _run(tmp_path, recorder, expired=True)._finish()  # no exception: the budget
    assert [end["why"] for end in recorder.ends] == ["failed", "failed", "budget"]


def test_a_loop_that_raises_after_its_budget_expired_is_recorded_as_failed(tmp_path):
    recorder = _Recorder()
    run = _run(tmp_path, recorder)
    expired = iter([False, True, True])  # checked before the batch, then by _finish

    def next_batch(*a):
        raise RuntimeError("the batch failed")

    run.settings = SimpleNamespace(steps=5, eval_tasks=0, eval_at_start=False, max_wall_s=1.0)
    run.clock = SimpleNamespace(expired=lambda: next(expired), start=lambda: None)
    run.parts.backend = SimpleNamespace(start=lambda: None, ready=lambda: True, shutdown=lambda: None)
    run.feed = SimpleNamespace(start=lambda: None, stop=lambda: None, next_batch=next_batch)
    with pytest.raises(RuntimeError, match="the batch failed"):
        run.loop()
    assert [end["why"] for end in recorder.ends] == ["failed"]
    phases = [r["phase"] for r in recorder.ends[0]["memory"]["phases"]]  # the run's own watch
    assert phases == ["workers starting", "RL steps", "final checkpoint and shutdown"]
    assert any(line.startswith("peak memory (RSS, MiB") for line in recorder.lines)
    assert run.memory.current is None  # stopped
