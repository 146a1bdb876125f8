"""``saorl experiment --jobs N``: an experiment's runs N at a time, each in a process of its own.

The parent first makes what the runs share, one run after another: every pending run's SFT warm
start and value-pretrained critic (both cached under ``OUT/.cache`` by their settings; two
processes making one cache entry would do the work twice and race on its directory). Then it starts
a child per run, seed by seed (so the first seeds' pairs finish first), at most ``N`` at once:
``saorl experiment SPEC ... --out OUT --run ARM:SEED``, which trains that one run exactly as the
serial runner does (:meth:`ExperimentRunner.run_one`) and writes its output to
``OUT/logs/ARM-seedS.log`` (a traceback too when the command has ``--debug``: ``SAORL_DEBUG``
passes it on). A child runs in a session of its own (a terminal's Ctrl-C reaches the parent alone,
which passes it on) and dies with the parent (:mod:`saorl.parent_death`), so a parent killed
outright leaves no run writing into ``OUT``; every run resumes from its last checkpoint on the next
invocation, as a serial run does.

A child that fails stops new starts; the runs in flight finish (or stop at their budget) and the
experiment stops with the failed run's log tail (exit status 1). Ctrl-C or SIGTERM to the parent
is passed on to the children as Ctrl-C: each stops the way a run stops (resumable; a second Ctrl-C
is passed on too and stops them at once, as it stops one run), and the parent waits for them (at
most ``STOP_WAIT_S``, then kills what is left). Either way the start arm's rows are written for
every seed whose trained runs all finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from saorl.experiments.runner import (
    DONE_FILE,
    ExperimentInterrupted,
    ExperimentRunner,
    RunResult,
    is_finished,
    run_dir_for,
)

PARENT_ENV = "SAORL_EXPERIMENT_PARENT"
"""The parent's pid, given to each child: it dies with that process (even one gone before the child
got as far as checking)."""

POLL_S = 0.5
STOP_WAIT_S = 300.0
"""How long the parent waits for children it asked to stop before it kills them."""


def log_path(out: Path, arm: str, seed: int) -> Path:
    return out / "logs" / f"{arm}-seed{seed}.log"


def child_command(spec_ref: str, out: Path, arm: str, seed: int, quick: bool, extra: list[str]) -> list[str]:
    """The command line of one run's child: the same spec, overrides and mode, this run only."""
    return [sys.executable, "-c", "import sys; from saorl.cli import main; sys.exit(main(sys.argv[1:]))",
            "experiment", spec_ref, *extra, *(["--quick"] if quick else []), "--out", str(out),
            "--run", f"{arm}:{seed}"]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ExperimentFailed(ExperimentInterrupted):
    """A run's child failed (not stopped): the experiment stops, resumable, with its log's tail."""


def _print(message: str) -> None:
    print(message, flush=True)


def run_parallel(runner: ExperimentRunner, spec_ref: str, jobs: int,
                 log: Callable[[str], None] = _print, debug: bool = False) -> list[RunResult]:
    """Every selected trained run of ``runner`` not finished yet, ``jobs`` at a time (module
    docstring), then the start arm's rows of every seed whose trained runs all finished (also when
    the experiment stops early, as the serial runner leaves them); the results in the serial
    runner's order."""
    out = runner.out
    out.mkdir(parents=True, exist_ok=True)
    runner.save_spec()
    runner.check_same_start()
    order = [(arm, seed) for seed in runner.sel.seeds for arm in runner.trained_arms()]
    results: dict[tuple[str, int], RunResult] = {}
    pending = []
    for arm, seed in order:
        if is_finished(run_dir_for(out, arm, seed)):
            results[arm, seed] = runner.run_one(arm, seed)  # "finished earlier": skipped, as serially
        else:
            pending.append((arm, seed))
    for arm, seed in pending:  # the shared caches, one at a time, before any child starts
        runner.prepare(arm, seed)
    (out / "logs").mkdir(exist_ok=True)
    log(f"[experiment] {len(pending)} run(s), {jobs} at a time; each run's output in {out / 'logs'}")
    running: dict[tuple[str, int], tuple[subprocess.Popen, float]] = {}
    failed: list[str] = []
    stop = {"asked": False}

    def ask_stop(signum=None, frame=None) -> None:
        if stop["asked"]:  # a second Ctrl-C: passed on again, which stops a run at once
            for proc, _ in running.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
        stop["asked"] = True

    previous = {sig: signal.signal(sig, ask_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (pending and not failed and not stop["asked"]) or running:
            while pending and len(running) < jobs and not failed and not stop["asked"]:
                arm, seed = pending.pop(0)
                path = log_path(out, arm, seed)
                with open(path, "a", encoding="utf-8") as fh:
                    proc = subprocess.Popen(
                        child_command(spec_ref, out, arm, seed, runner.sel.quick, list(runner.sel.extra)),
                        stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                        env={**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1",
                             **({"SAORL_DEBUG": "1"} if debug else {})})
                running[arm, seed] = (proc, time.monotonic())
                log(f"[{arm} seed {seed}] started (pid {proc.pid})")
            time.sleep(POLL_S)
            if stop["asked"]:
                _stop_children(running, log)
            for (arm, seed), (proc, t0) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[arm, seed]
                run_dir = run_dir_for(out, arm, seed)
                if rc == 0 and is_finished(run_dir):
                    done = json.loads((run_dir / DONE_FILE).read_text())
                    results[arm, seed] = RunResult(arm, seed, str(run_dir), "trained", done["steps"],
                                                   done["wall_s"])
                    log(f"[{arm} seed {seed}] done: {done['steps']} steps in {time.monotonic() - t0:.0f}s")
                elif not stop["asked"]:
                    failed.append(f"[{arm} seed {seed}] exited with status {rc}; the end of "
                                  f"{log_path(out, arm, seed)}:\n{_tail(log_path(out, arm, seed))}")
                    log(f"[{arm} seed {seed}] failed (exit status {rc}): no new runs start")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if running:  # an exception of our own: leave no child behind
            _stop_children(running, log)
    starts = []
    if runner.spec.start_arm and runner.spec.start_arm in runner.sel.arms:
        starts = [runner.run_start_arm(seed) for seed in runner.sel.seeds
                  if all(is_finished(run_dir_for(out, arm, seed)) for arm in runner.trained_arms())]
    if stop["asked"]:
        raise ExperimentInterrupted("stopped (Ctrl-C or SIGTERM); every run resumes from its last "
                                    "checkpoint when the same command runs again")
    if failed:
        raise ExperimentFailed("\n".join(failed) + "\nrun the same command again to resume (with --debug "
                               "for a failed run's traceback in its log)")
    return [results[k] for k in order if k in results] + starts


def _stop_children(running: dict, log: Callable[[str], None]) -> None:
    """Ctrl-C to every child still running, then wait for them (at most :data:`STOP_WAIT_S`), then
    kill what is left; ``running`` is emptied."""
    for (arm, seed), (proc, _) in running.items():
        if proc.poll() is None:
            log(f"[{arm} seed {seed}] asked to stop")
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    for proc, _ in running.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    running.clear()
