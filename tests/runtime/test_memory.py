"""MemoryWatch on real processes: a known allocation in a phase moves that phase's peak by about
its size (this process, a titled helper, the run in all), and a spike shorter than a sample is
still caught in this process (its VmHWM reset at each switch)."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from saorl.runtime.memory import OTHER, MemoryWatch, format_memory, label, status_mib

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")

MIB = 2**20


def _touch(mib: int) -> mmap.mmap:
    """``mib`` MiB of fresh pages, written (so resident); unmapped when dropped. An anonymous mapping,
    not the heap: in a long-lived process (the whole suite) the heap reuses pages already resident,
    which would not move the RSS."""
    m = mmap.mmap(-1, mib * MIB)
    for i in range(0, mib * MIB, mmap.PAGESIZE):
        m[i] = 1
    return m


def _row(report: dict, phase: str) -> dict:
    return next(r for r in report["phases"] if r["phase"] == phase)


def test_a_phase_allocation_moves_that_phase_peak_by_its_size():
    watch = MemoryWatch(interval_s=0.05).start("small")
    time.sleep(0.2)
    watch.enter("big")
    x = _touch(300)
    time.sleep(0.2)
    del x
    watch.enter("after")
    time.sleep(0.2)
    report = watch.stop()
    small, big, after = (_row(report, p) for p in ("small", "big", "after"))
    assert 270 <= big["trainer_mib"] - small["trainer_mib"] <= 340
    assert big["trainer_mib"] - after["trainer_mib"] >= 270  # the reset: "after" does not inherit it
    assert report["peak"]["trainer_phase"] == "big" and report["peak"]["total_phase"] == "big"
    assert [r["phase"] for r in report["phases"]] == ["small", "big", "after"]
    assert all(r["seconds"] >= 0.15 for r in report["phases"])


def test_a_spike_shorter_than_a_sample_is_caught_in_this_process():
    watch = MemoryWatch(interval_s=30).start("quiet")  # no sample of the thread runs during the test
    watch.enter("spike")
    x = _touch(200)
    del x
    watch.enter("quiet")
    report = watch.stop()
    if not report["trainer_resets"]:
        pytest.skip("this kernel refuses /proc/self/clear_refs")
    assert _row(report, "spike")["trainer_mib"] - _row(report, "quiet")["trainer_mib"] >= 180


def test_a_phase_entered_twice_keeps_one_row_with_its_largest_peak():
    watch = MemoryWatch(interval_s=0.05).start("steps")
    with watch.phase("eval"):
        x = _touch(200)
        time.sleep(0.1)
        del x
    assert watch.current == "steps"
    with watch.phase("eval"):
        time.sleep(0.1)
    report = watch.stop()
    assert [r["phase"] for r in report["phases"]] == ["steps", "eval"]
    assert _row(report, "eval")["trainer_mib"] - _row(report, "steps")["trainer_mib"] >= 180
    assert watch.current is None


def _helper(mib: int, title: str | None) -> subprocess.Popen:
    """A child that (optionally titles itself) allocates ``mib`` MiB, says so, then waits."""
    titled = f"from saorl.proctitle import set_title; set_title({title!r})" if title else ""
    code = textwrap.dedent(f"""
        import sys
        {titled}
        x = bytearray({mib} * 2**20)
        for i in range(0, len(x), 4096):
            x[i] = 1
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=Path(__file__).resolve().parents[2])
    assert p.stdout.readline().strip() == "ready"
    return p


def test_helpers_are_sampled_under_their_titles_and_summed_into_the_run():
    watch = MemoryWatch(interval_s=0.05).start("alone")
    time.sleep(0.2)
    watch.enter("helpers")
    worker = _helper(250, "rollout worker 0")
    other = _helper(100, None)
    try:
        assert label(worker.pid) == "rollout worker 0" and label(other.pid) == OTHER
        base = status_mib(other.pid) - 100
        time.sleep(0.3)
        report = watch.report()  # while they run: the open phase so far
    finally:
        for p in (worker, other):
            p.communicate("\n", timeout=10)
    watch.stop()
    row = _row(report, "helpers")
    alone = _row(report, "alone")
    already = alone["helpers_mib"].get(OTHER, 0)  # children an earlier test of the suite left running
    assert set(alone["helpers_mib"]) <= {OTHER}
    assert 240 <= row["helpers_mib"]["rollout worker 0"] - base <= 300
    assert 90 <= row["helpers_mib"][OTHER] - already - base <= 150
    helpers = sum(row["helpers_mib"].values())
    assert row["total_mib"] >= helpers + alone["trainer_mib"] - 30
    assert report["peak"]["helpers_mib"]["rollout worker 0"] == row["helpers_mib"]["rollout worker 0"]
    table = format_memory(report)
    assert "| helpers |" in table and "rollout worker 0" in table and "run in all" in table


def test_a_watch_never_started_reports_nothing_and_bad_intervals_are_refused():
    watch = MemoryWatch()
    watch.enter("x")  # a no-op: not started
    assert watch.stop()["phases"] == [] and watch.current is None
    assert "not measured" in format_memory(watch.report())
    with pytest.raises(ValueError, match="interval_s must be positive"):
        MemoryWatch(interval_s=0)
