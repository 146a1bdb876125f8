"""Peak memory of a run, phase by phase: the trainer process, each helper process it started
(rollout workers, reward hosts), and the run in all.

Linux keeps one peak per process, ``VmHWM`` (what ``ru_maxrss`` reads), over its whole life, which
says nothing about which phase reached it. :class:`MemoryWatch` splits it by phase:

- **this process** (the trainer): at each phase switch its ``VmHWM`` since the last switch is read
  and then reset (``5`` written to ``/proc/self/clear_refs``), so a phase's peak includes spikes
  shorter than a sample; where the reset is refused, the samples below alone. (So, in a process
  where a watch ran, ``ru_maxrss`` is the peak since its last switch, not since the start;)
- **its descendants**: a thread reads ``VmRSS`` of every process under this one every
  ``interval_s`` (``/proc/PID/task/*/children``), each under its label — a saorl helper's title
  (``rollout worker 0``: :mod:`saorl.proctitle`), anything else summed as ``other processes`` —
  so a helper's spike shorter than a sample can be missed;
- **the run in all**: the largest sum over this process and its descendants at one sample. Pages
  that two processes share (a model file both map) count in each, so the sum can exceed what the
  machine lost: an upper bound, as the OOM killer, which scores each process by its RSS, sees it;
  never less than the trainer's own peak of the phase.

A phase entered more than once (RL steps around evaluations) keeps one row: its largest peaks and
its seconds summed. Off Linux (no ``/proc``) nothing is measured and the report has no phases.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")
OTHER = "other processes"
"""The label of descendants that are not titled saorl helpers (summed at each sample)."""


def status_mib(pid: int | str, field: str = "VmRSS") -> float | None:
    """``field`` of ``/proc/PID/status`` in MiB (None: the process is gone, or no ``/proc``)."""
    try:
        with open(PROC / str(pid) / "status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children of each of its threads, recursively)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(PROC / str(p) / "task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = (PROC / str(p) / "task" / t / "children").read_text().split()
            except OSError:
                continue
            for k in kids:
                if int(k) not in out:
                    out.append(int(k))
                    todo.append(int(k))
    return out


def label(pid: int) -> str:
    """``rollout worker 0`` for a titled saorl helper (``saorl: rollout worker 0 of run NAME``),
    else :data:`OTHER`."""
    try:
        args = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return OTHER
    if not args.startswith("saorl: "):
        return OTHER
    return args.removeprefix("saorl: ").split(" of run ")[0].strip() or OTHER


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS; False where the kernel refuses."""
    try:
        with open(PROC / "self" / "clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Phase:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds = 0.0
        self.trainer = 0.0
        self.helpers: dict[str, float] = {}
        self.total = 0.0

    def row(self) -> dict:
        return {"phase": self.name, "seconds": round(self.seconds, 1), "trainer_mib": round(self.trainer),
                "helpers_mib": {k: round(v) for k, v in sorted(self.helpers.items())},
                "total_mib": round(self.total)}


class MemoryWatch:
    """Peak RSS per phase of this process, its descendants and the run in all (module docstring).

    ``start(phase)`` begins sampling every ``interval_s``; ``enter(phase)`` switches phase;
    ``with watch.phase(name)`` enters one and goes back to the phase before; ``stop()`` ends the
    sampling; ``report()`` is the rows so far. A watch that never started reports nothing, so a
    caller may hold one unconditionally."""

    def __init__(self, interval_s: float = 0.5) -> None:
        if interval_s <= 0:
            raise ValueError(f"MemoryWatch interval_s must be positive (got {interval_s})")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._phases: dict[str, _Phase] = {}
        self._current: _Phase | None = None
        self._since = 0.0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._resets = False
        self.available = (PROC / "self" / "status").is_file()

    @property
    def current(self) -> str | None:
        """The phase now (None before start and after stop)."""
        return self._current.name if self._current is not None else None

    def start(self, phase: str) -> MemoryWatch:
        """Begin in ``phase`` (a no-op off Linux, or when already started)."""
        if not self.available or self._thread is not None:
            return self
        self._resets = reset_peak()
        self._enter(phase)
        self._thread = threading.Thread(target=self._run, name="saorl-memory", daemon=True)
        self._thread.start()
        return self

    def enter(self, phase: str) -> None:
        """Switch to ``phase`` (the one before ends here); a no-op when not started."""
        if self._thread is not None and not self._stopped.is_set():
            self._enter(phase)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``name`` for the block, then the phase before it again."""
        before = self.current
        self.enter(name)
        try:
            yield
        finally:
            if before is not None:
                self.enter(before)

    def stop(self) -> dict:
        """End the sampling (the current phase ends here); the report."""
        if self._thread is not None and not self._stopped.is_set():
            self._stopped.set()
            self._thread.join()
            with self._lock:
                self._close_current()
                self._current = None
        return self.report()

    def report(self) -> dict:
        """``{"interval_s", "phases": [row...], "peak": {...}}``; a row: ``phase``, ``seconds``,
        ``trainer_mib`` (this process), ``helpers_mib`` (label → MiB), ``total_mib`` (the run in
        all). ``peak``: the largest of each over the phases and the phase it was in."""
        with self._lock:
            if self._current is not None:
                self._sample_locked(hwm=True)
            rows = [p.row() for p in self._phases.values()]
            if self._current is not None:  # the open phase's seconds so far
                for r in rows:
                    if r["phase"] == self._current.name:
                        r["seconds"] = round(self._current.seconds + time.monotonic() - self._since, 1)
        peak: dict = {}
        for key in ("trainer_mib", "total_mib"):
            if rows:
                top = max(rows, key=lambda r: r[key])
                peak[key], peak[key.removesuffix("_mib") + "_phase"] = top[key], top["phase"]
        helpers: dict[str, float] = {}
        for r in rows:
            for k, v in r["helpers_mib"].items():
                helpers[k] = max(helpers.get(k, 0), v)
        peak["helpers_mib"] = dict(sorted(helpers.items()))
        return {"interval_s": self.interval_s, "trainer_resets": self._resets, "phases": rows, "peak": peak}

    # ---------------------------------------------------------------- internals
    def _enter(self, phase: str) -> None:
        with self._lock:
            self._close_current()
            self._current = self._phases.setdefault(phase, _Phase(phase))
            self._since = time.monotonic()
            if self._resets:
                self._resets = reset_peak()
            self._sample_locked(hwm=False)

    def _close_current(self) -> None:
        """Fold this process's peak since the last switch into the current phase."""
        if self._current is None:
            return
        self._sample_locked(hwm=True)
        self._current.seconds += time.monotonic() - self._since

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            with self._lock:
                if self._current is not None:
                    self._sample_locked(hwm=True)

    def _sample_locked(self, *, hwm: bool) -> None:
        """One sample into the current phase. ``hwm``: count this process's ``VmHWM`` too (the
        peak since the last reset, which belongs to this phase only while resets work)."""
        me = os.getpid()
        rss = status_mib(me) or 0.0
        trainer = max(rss, status_mib(me, "VmHWM") or 0.0) if hwm and self._resets else rss
        helpers: dict[str, float] = {}
        for pid in descendants(me):
            mib = status_mib(pid)
            if mib:
                name = label(pid)
                helpers[name] = helpers.get(name, 0.0) + mib
        p = self._current
        p.trainer = max(p.trainer, trainer)
        for k, v in helpers.items():
            p.helpers[k] = max(p.helpers.get(k, 0.0), v)
        p.total = max(p.total, rss + sum(helpers.values()), p.trainer)


def format_memory(report: dict, columns: int = 4) -> str:
    """The report as a table (MiB): a row per phase; the trainer, the ``columns`` helpers of the
    largest peaks (the rest in ``report`` only), the run in all."""
    rows = report.get("phases") or []
    if not rows:
        return "peak memory: not measured here (no /proc)"
    helpers = sorted(report["peak"]["helpers_mib"], key=lambda k: -report["peak"]["helpers_mib"][k])[:columns]
    head = ["phase", "seconds", "trainer", *helpers, "run in all"]
    lines = [f"peak memory (RSS, MiB; helpers sampled every {report['interval_s']:g} s):",
             "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        cells = [r["phase"], f"{r['seconds']:.0f}", str(r["trainer_mib"]),
                 *(str(r["helpers_mib"].get(h, "–")) for h in helpers), str(r["total_mib"])]
        lines.append("| " + " | ".join(cells) + " |")
    p = report["peak"]
    lines.append(f"peak: trainer {p['trainer_mib']} MiB ({p['trainer_phase']}), the run in all "
                 f"{p['total_mib']} MiB ({p['total_phase']})")
    return "\n".join(lines)
