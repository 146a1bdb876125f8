"""Telling a slow rollout worker from a stalled one, by its progress, not by its messages.

A worker's messages are a poor sign of life: on a loaded machine its event loop can be held for a
minute by one weight load that waits for the engine's current forward (``update_weights`` blocks
until it is applied between decode steps), and a heartbeat-only watchdog then kills a healthy,
merely slow worker. So the local backend watches **progress**, read without any message:

- the worker's :class:`WorkerPulse`, shared memory it writes as it works: the engine's work
  (tokens decoded, prompt tokens prefilled, requests finished, weights applied; copied by a small
  thread, so it moves even while the event loop is held) and the calls it makes (each turn of its
  request loop, each rollout it finishes);
- the process's CPU time (``/proc/PID/stat``): a forward or a weight load that takes minutes uses
  CPU all along. A worker stopped (``SIGSTOP``), deadlocked or waiting on a call that never
  returns uses none — at most the pulse thread's few microseconds a second, far below
  :data:`CPU_PROGRESS_FRAC`.

:class:`StallWatch` restarts a worker only when none of these moved for its limit::

    limit = max(runtime.worker_stall_s, GAP_FACTOR × longest gap seen) × max(1, load / cores)

— the longest stretch without progress that the worker came out of by itself (its slowest
weight load or forward so far, measured), and the machine's 1-minute load average per core
(:func:`load_factor`). A worker that makes progress is never restarted, however slow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

GAP_FACTOR = 3.0
"""How many times its longest measured gap a worker may go without progress."""
CPU_PROGRESS_FRAC = 0.01
CPU_PROGRESS_MIN_S = 0.02
"""CPU use that counts as progress: at least 1% of a core since the worker's last progress (and
two clock ticks). A slow worker on a machine at load 20 per core still gets several percent; the
pulse thread of a stopped or deadlocked one uses about 0.02%."""
WATCH_GAP_S = 2.0
"""Checks further apart than this (the trainer busy with a step) measure no gap: the watch was
not looking, so the stretch is not the worker's."""
ENGINE_WORK = ("tokens_generated", "prefill_tokens", "fed_tokens", "requests_finished", "weight_updates")
"""The engine counters (``InferenceEngine.stats()``) whose sum is the pulse's work."""


class WorkerPulse:
    """Two progress counters in shared memory: written by the worker, read by its backend.

    Made by the backend from its multiprocessing context and passed to the worker at spawn."""

    def __init__(self, ctx) -> None:
        self._array = ctx.RawArray("d", 2)

    def work(self, stats: dict[str, float]) -> None:
        """The engine's work so far (worker side)."""
        self._array[0] = float(sum(stats.get(k, 0) for k in ENGINE_WORK))

    def call(self) -> None:
        """One more call made: a turn of the request loop, a rollout finished (worker side)."""
        self._array[1] += 1.0

    def read(self) -> tuple[float, float]:
        return self._array[0], self._array[1]


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), or None where ``/proc`` has none."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def load_factor() -> float:
    """The 1-minute load average per core, at least 1 (1 where the OS does not tell)."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


@dataclass
class _Seen:
    sample: tuple | None = None
    cpu: float | None = None
    progress_at: float = 0.0
    checked_at: float = 0.0
    longest_gap: float = 0.0
    blind: bool = False


class StallWatch:
    """The stall limits of ``n`` workers (module docstring); ``stall_s`` is
    ``runtime.worker_stall_s``; ``load`` and ``clock`` are for tests."""

    def __init__(self, n: int, stall_s: float, load: Callable[[], float] = load_factor,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s, self.load, self.clock = stall_s, load, clock
        self._seen: list[_Seen | None] = [None] * n

    def forget(self, i: int) -> None:
        """Worker ``i`` was (re)started: not judged until :meth:`watch` (its engine is built)."""
        self._seen[i] = None

    def watch(self, i: int) -> None:
        if self._seen[i] is None:
            now = self.clock()
            self._seen[i] = _Seen(progress_at=now, checked_at=now)

    def limit(self, i: int) -> float:
        seen = self._seen[i]
        gap = seen.longest_gap if seen is not None else 0.0
        return max(self.stall_s, GAP_FACTOR * gap) * self.load()

    def stalled(self, i: int, sample: tuple, cpu: float | None) -> float | None:
        """Seconds worker ``i`` has made no progress, if that is past its limit; else None.
        ``sample``: its pulse's counters now; ``cpu``: its CPU seconds now (None: unknown)."""
        seen = self._seen[i]
        if seen is None:
            return None
        now = self.clock()
        if now - seen.checked_at > WATCH_GAP_S:
            seen.blind = True  # a stretch that ends in progress now was not all watched
        seen.checked_at = now
        if seen.sample is None:
            seen.sample, seen.cpu = sample, cpu
            return None
        away = now - seen.progress_at
        used = (cpu is not None and seen.cpu is not None
                and cpu - seen.cpu >= max(CPU_PROGRESS_MIN_S, CPU_PROGRESS_FRAC * away))
        if sample != seen.sample or used:
            if not seen.blind:
                seen.longest_gap = max(seen.longest_gap, away)
            seen.sample, seen.cpu, seen.progress_at, seen.blind = sample, cpu, now, False
            return None
        return away if away > self.limit(i) else None

    def why(self, i: int, idle: float) -> str:
        """The restart message's reason (after ``rollout worker I``)."""
        load = self.load()
        return (f"made no progress for {idle:.0f} s (no token decoded, no call made, no CPU used; its limit "
                f"{self.limit(i):.0f} s = max(runtime.worker_stall_s={self.stall_s:g}, {GAP_FACTOR:g} × its "
                f"longest gap so far) × load {load:.1f} per core: stopped, deadlocked or stuck); killed")
