"""Everything a run writes into its directory besides checkpoints, journal and weights, and the
run's clock.

:class:`RunRecorder` owns ``metrics.jsonl`` (one line per logged row: the step-0 evaluation, then
one per trainer step), the trackers of ``run.report_to`` (TensorBoard, W&B, MLflow, ...:
:mod:`saorl.runtime.trackers`, which get the same rows), the live progress line, ``eval.jsonl``,
``trained.jsonl`` (the audit trail: which rollouts each step trained on), ``errors.log`` (the
full text of the failures the run survived), ``samples/`` and the final export (``final/policy``,
``final/critic``).
:class:`StepClock` owns the wall-clock budget and the ``time/*`` metrics of each step, so the
run loop does no clock arithmetic of its own. :class:`CountProgress` shows the progress of a
counted job (an evaluation's episodes, value-pretraining rollouts, SFT steps) the way the run shows
its steps: a rich bar on a terminal, plain lines on stderr otherwise.

A resumed run redoes the steps logged after its checkpoint. It first appends a **resume
marker**, ``{"resume": {"from_step": S, "checkpoint": ..., "pending": ..., "version": ...,
"time": ...}}``, to both ``trained.jsonl`` and ``metrics.jsonl``: the rows before the marker
with ``step > S`` were rolled back. :func:`effective_rows` applies the markers, so an audit
of ``trained.jsonl`` counts each rollout once. Marker rows have no ``step`` key.

A start that ends in order (its steps done, its budget spent, stopped by Ctrl-C, or failed in a
way it could report) writes ``end.json``, ``{"step": S, "steps": N, "why": ..., "memory": ..., "time": ...}``
(``memory``: the peak RSS per phase, :meth:`saorl.runtime.memory.MemoryWatch.report`); a
run killed (kill -9, the OOM killer) has none written after its last resume marker, which is how
``saorl plot`` tells a run that stopped without finishing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from saorl.atomic import write_text
from saorl.data.trajectory import Trajectory
from saorl.run_paths import RunPaths
from saorl.runtime.trackers import Trackers

REQUIRED_KEYS = (
    "step", "policy/version", "reward/mean", "policy/dis_kept_frac", "rollout/staleness_mean",
    "rollout/staleness_max", "critic/value_loss", "critic/explained_var", "time/trainer_idle_frac",
    "throughput/trajectories_per_s", "throughput/action_tokens_per_s",
)
SAMPLES_PER_STEP = 4


def effective_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step rows of ``trained.jsonl`` or ``metrics.jsonl`` that stand: each resume marker
    drops the rows before it whose step is past the checkpoint it resumed from."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if "resume" in row:
            out = [r for r in out if r["step"] <= row["resume"]["from_step"]]
        elif "step" in row:
            out.append(row)
    return out


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a missing value is logged as null
    return v


class RunRecorder:
    """The run directory's logs, samples and final export (see the module docstring)."""

    def __init__(self, run_dir: Path, tokenizer: Any, *, progress: bool = True,
                 total_steps: int | None = None, trackers: Trackers | None = None) -> None:
        self.dir, self.tokenizer = run_dir, tokenizer
        self.paths = RunPaths(run_dir)
        self._metrics = open(self.paths.metrics, "a", encoding="utf-8")
        self._trained = open(self.paths.trained, "a", encoding="utf-8")
        self.trackers = trackers
        self._progress = None
        if progress and sys.stderr.isatty():
            self._progress = step_progress()
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()
        self.last_eval: dict[str, float] = {}
        self.last_eval_step: int | None = None
        self.best_eval: tuple[float, int] | None = None  # (accuracy, step) of the best evaluation
        self._read_best()

    # --------------------------------------------------------------------------- metrics
    def log_step(self, metrics: dict[str, Any]) -> None:
        """One row (a trainer step's metrics, or the step-0 evaluation): ``metrics.jsonl``, every
        tracker, the progress line."""
        row = {k: _clean(v) for k, v in metrics.items()}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self.trackers is not None:
            self.trackers.log(metrics, int(metrics["step"]))
        if any(k.startswith("eval/") for k in metrics):
            self.last_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        self._show(metrics)

    def log_eval(self, step: int, version: int, metrics: dict[str, float]) -> None:
        """One evaluation: a line of ``eval.jsonl``, and one kept line on the console,
        ``step N eval: accuracy X (best Y at step Z)`` (the live line above it is redrawn; this one stays)."""
        with open(self.paths.eval, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "policy/version": version, **metrics}) + "\n")
        acc = metrics.get("eval/accuracy")
        self.last_eval_step = step
        if acc is None or not math.isfinite(acc):
            return
        if self.best_eval is None or acc > self.best_eval[0]:
            self.best_eval = (acc, step)
        self.message(eval_line(step, acc, self.best_eval))
        for key, value in sorted(metrics.items()):  # a mix's parts: one line each
            part = key[len("eval/"):-len("/accuracy")]
            if key.startswith("eval/") and key.endswith("/accuracy") and part and "/" not in part:
                n = metrics.get(f"eval/{part}/episodes")
                self.message(f"step {step} eval {part}: accuracy {value:.3f}"
                             + ("" if n is None else f" ({int(n)} episodes)"))

    def _read_best(self) -> None:
        """A resumed run's best evaluation so far, from its ``eval.jsonl``."""
        self.best_eval = best_of(evaluations(self.paths.eval))

    def _show(self, m: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=int(m["step"]), info=self.info(m))
        else:
            print(f"step {int(m['step'])} | {self.info(m)}", file=sys.stderr, flush=True)

    def info(self, m: dict[str, Any]) -> str:
        """The stats of the progress line, most telling first (a narrow terminal cuts the end):
        the latest evaluation and the step it was at, the batch's reward, staleness, trainer idle
        time, throughput."""
        acc = self.last_eval.get("eval/accuracy")
        reward = m.get("reward/mean")
        at = "" if self.last_eval_step is None else f" @{self.last_eval_step}"
        return (f"eval acc {'-' if acc is None else f'{acc:.3f}{at}'} | "
                f"reward {'-' if reward is None else f'{reward:.3f}'} | "
                f"stale {m.get('rollout/staleness_mean', 0):.2f} | "
                f"idle {m.get('time/trainer_idle_frac', 0):.0%} | "
                f"{m.get('throughput/action_tokens_per_s', 0):.0f} tok/s")

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def error(self, text: str) -> None:
        """A failure the run survives (a rollout that raised, a worker that died): its first line on
        the console, the whole text (the traceback) appended to ``errors.log``."""
        with open(self.paths.errors, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")
        first = text.strip().splitlines()[0] if text.strip() else text
        more = " (traceback in errors.log)" if "\n" in text.strip() else ""
        self.message(first + more)

    def alarm(self, row: dict[str, Any]) -> None:
        """An alarm of :mod:`saorl.runtime.alarms`: its line on the console, its row appended to
        ``alarms.jsonl``."""
        with open(self.paths.alarms, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self.message(row["text"])

    def count(self, label: str) -> CountProgress:
        """Progress of a counted job inside the run (an evaluation): a second bar under the run's
        own on a terminal, else a line every :data:`PROGRESS_EVERY_S` seconds."""
        return CountProgress(label, bar=self._progress, enabled=True, log=self.message)

    def resumed(self, info: dict[str, Any]) -> None:
        """The resume marker (see the module docstring), in ``trained.jsonl`` and ``metrics.jsonl``."""
        line = json.dumps({"resume": {**info, "time": time.time()}}) + "\n"
        for f in (self._trained, self._metrics):
            f.write(line)
            f.flush()

    def ended(self, info: dict[str, Any]) -> None:
        """``end.json`` (see the module docstring)."""
        write_text(self.paths.end, json.dumps({**info, "time": time.time()}) + "\n")

    # ----------------------------------------------------------------- trajectories
    def trained(self, step: int, trajs: list[Trajectory], train_start: float, train_end: float) -> None:
        """Audit trail and timeline: which rollouts (tasks, versions, sampling times, workers) a
        step trained on, and when it trained (wall-clock seconds since the epoch)."""
        eps = [t.episode for t in trajs]
        row = {"step": step, "rids": [e.rid for e in eps], "task_ids": [t.task_id for t in trajs],
               "versions": [sorted(set(t.action_versions)) for t in trajs],
               "action_tokens": [t.num_action_tokens for t in trajs], "workers": [e.worker for e in eps],
               "rollout_start": [e.t_start for e in eps], "rollout_end": [e.t_end for e in eps],
               "train_start": train_start, "train_end": train_end}
        self._trained.write(json.dumps(row) + "\n")
        self._trained.flush()

    def samples(self, step: int, trajs: list[Trajectory]) -> None:
        """A few decoded trajectories: ``samples/step-N.txt`` and ``samples/samples.jsonl``."""
        from saorl.agent.render import render_trajectory

        directory = self.paths.samples
        directory.mkdir(parents=True, exist_ok=True)
        shown = trajs[:SAMPLES_PER_STEP]
        with open(directory / f"step-{step:08d}.txt", "w", encoding="utf-8") as f:
            for t in shown:
                versions = sorted(set(t.action_versions))
                f.write(f"=== task {t.task_id} reward {t.total_reward:.3f} versions {versions}\n")
                f.write(render_trajectory(t, self.tokenizer, color=False) + "\n\n")
        with open(directory / "samples.jsonl", "a", encoding="utf-8") as f:
            for t in shown:
                f.write(json.dumps({"step": step, **t.to_dict()}) + "\n")

    def export_final(self, policy, critic) -> None:
        """``final/policy`` (an HF directory with the tokenizer) and ``final/critic``; for a LoRA
        policy ``final/policy`` is base + adapter merged, and ``final/adapter`` the adapter alone
        (peft's layout; :mod:`saorl.models.lora`)."""
        from saorl.models.lora import is_lora, merged_copy, save_adapter
        from saorl.models.serialize import export_policy, save_critic

        if is_lora(policy):
            save_adapter(policy, self.paths.final_adapter)
            policy = merged_copy(policy)
        export_policy(policy, self.tokenizer, self.paths.final_policy)
        if critic is not None:
            save_critic(critic, self.paths.final_critic)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.trackers is not None:
            self.trackers.close()
        self._metrics.close()
        self._trained.close()


def evaluations(path: Path) -> list[tuple[int, float]]:
    """The ``(step, accuracy)`` of each evaluation in an ``eval.jsonl`` (none when it is missing)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
            acc, step = float(row["eval/accuracy"]), int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if math.isfinite(acc):
            out.append((step, acc))
    return out


def best_of(evals: list[tuple[int, float]]) -> tuple[float, int] | None:
    """``(accuracy, step)`` of the best evaluation (the earliest of equals), or None."""
    best = None
    for step, acc in evals:
        if best is None or acc > best[0]:
            best = (acc, step)
    return best


def eval_line(step: int, accuracy: float, best: tuple[float, int]) -> str:
    """The kept console line of one evaluation."""
    return f"step {step} eval: accuracy {accuracy:.3f} (best {best[0]:.3f} at step {best[1]})"


def step_progress(*, console: Any = None) -> Any:
    """The live progress display of a run: ``train <bar> N/M 0:01:23 <stats>``. The label, the
    step counter and the elapsed time keep their width at any terminal width; the bar narrows and
    the stats (the last column) are cut with an ellipsis first."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    fixed = Column(no_wrap=True)
    return Progress(TextColumn("[bold]{task.description}", table_column=fixed),
                    BarColumn(bar_width=12), MofNCompleteColumn(table_column=fixed),
                    TimeElapsedColumn(table_column=fixed),
                    TextColumn("{task.fields[info]}",
                               table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis", min_width=1)),
                    expand=True, console=console)


PROGRESS_EVERY_S = 10.0
"""Without a terminal, a counted job reports a line this often (a shorter job prints none)."""


class CountProgress:
    """Progress of a counted job: call it with ``(done, total)`` as the count moves; close it at the end.

    On a terminal (stderr is a tty) with ``enabled``: a rich bar, added to ``bar`` (a live rich
    ``Progress``, e.g. the run's) or a bar of its own; otherwise ``log`` gets a line such as
    ``eval step 0: 48/128 (12s)`` at most every ``every_s`` seconds, so a job shorter than that
    prints nothing and a long one is never silent.
    """

    def __init__(self, label: str, *, bar: Any = None, enabled: bool = True,
                 every_s: float = PROGRESS_EVERY_S, log: Callable[[str], None] | None = None) -> None:
        self.label, self.every_s = label, every_s
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._own = None
        if bar is None and enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = self._own = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                       MofNCompleteColumn(), TimeElapsedColumn())
            bar.start()
        self._bar = bar if enabled else None
        self._task = self._bar.add_task(label, total=None, info="") if self._bar is not None else None
        self._t0 = self._last = time.monotonic()

    def __call__(self, done: int, total: int | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._log(f"{self.label}: {done}{'' if total is None else f'/{total}'} ({now - self._t0:.0f}s)")

    def close(self) -> None:
        if self._own is not None:
            self._own.stop()
        elif self._bar is not None:
            self._bar.remove_task(self._task)
        self._bar = None

    def __enter__(self) -> CountProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepClock:
    """The run's wall-clock budget and each step's ``time/*`` and throughput metrics."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self._t0 = self._last = self._train0 = 0.0
        self._wall0 = 0.0
        self.wait_total = 0.0

    def start(self) -> None:
        """The budget starts now (the rollout workers are ready)."""
        self._t0 = self._last = time.monotonic()

    def expired(self) -> bool:
        return self.budget_s is not None and self._t0 > 0 and time.monotonic() - self._t0 > self.budget_s

    def train_started(self) -> None:
        self._train0, self._wall0 = time.monotonic(), time.time()

    def train_interval(self) -> tuple[float, float]:
        """Wall-clock (start, now) of the step being trained, for the audit trail."""
        return self._wall0, time.time()

    def step_finished(self, wait_s: float, trajs: list[Trajectory]) -> dict[str, float]:
        """The ``time/*`` and ``throughput/*`` metrics of the step that just finished."""
        now = time.monotonic()
        window, elapsed = now - self._last, now - self._t0
        self.wait_total += wait_s
        self._last = now
        tokens = sum(t.num_action_tokens for t in trajs)
        return {
            "time/elapsed_s": elapsed, "time/wait_s": wait_s, "time/train_s": now - self._train0,
            "time/trainer_idle_frac": wait_s / window if window > 0 else 0.0,
            "time/trainer_idle_frac_total": self.wait_total / elapsed if elapsed > 0 else 0.0,
            "throughput/trajectories_per_s": len(trajs) / window if window > 0 else 0.0,
            "throughput/action_tokens_per_s": tokens / window if window > 0 else 0.0,
        }
