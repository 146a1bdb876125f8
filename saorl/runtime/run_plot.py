"""One run as one picture: ``saorl plot RUN_DIR`` (and the end of ``saorl train``, into ``run.png``).

Six panels over trainer steps, read from the run directory's ``metrics.jsonl`` (resume markers
applied: :func:`~saorl.runtime.recorder.effective_rows`) and ``eval.jsonl``:

- **reward**: the training batch's mean reward (``reward/mean``; a few trajectories, so noisy)
  and its running mean over :data:`SMOOTH` steps;
- **held-out accuracy**: every evaluation (``eval/accuracy``), the best one marked;
- **KL / drift**: the trainer-vs-sampler KL of the trained tokens (``mismatch/kl``) and the
  relative size of each policy update (``policy/update_rel``, right axis);
- **critic EV**: the critic's explained variance before the step's updates (``critic/explained_var``);
- **staleness**: policy versions between sampling and training, mean and max over the batch;
- **throughput**: action tokens trained per second, and the trainer's idle fraction (right axis).

A panel whose metric the run did not log (GRPO has no critic) says so instead of a curve.

Each step is drawn once: the rows a resume rolled back are left out, and so are the evaluations
it redid (the newest of a step's stands). Every resume is a dashed line at the step it resumed
from, on every panel; a run that stopped without finishing (killed: no ``end.json`` written after
its last start, and no trainer holds its directory) is a red line at its last step, and the title
says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saorl.errors import StartupError
from saorl.run_paths import RunPaths
from saorl.runtime.recorder import effective_rows
from saorl.runtime.rundir import RunDirError, check_not_in_use

SMOOTH = 10
"""Steps in the running mean drawn over a noisy per-step curve."""


class NotARunError(StartupError):
    """The directory holds no run to draw (exit 2); one paragraph."""


@dataclass
class History:
    """What happened to a run besides its steps: its resumes and how it ended."""

    resumes: list[int] = field(default_factory=list)
    """The step each resume went back to, in order."""
    end: dict[str, Any] | None = None
    """How the last start ended (``end.json``; None: it was killed, or is running)."""
    running: bool = False
    """A trainer holds the directory now."""

    @property
    def killed(self) -> bool:
        """Stopped without finishing: no ``end.json`` after the last start, and no trainer running."""
        return self.end is None and not self.running

    def describe(self, last_step: int) -> str:
        steps = ", ".join(str(s) for s in self.resumes)
        parts = [f"resumed from step{'s' if len(self.resumes) > 1 else ''} {steps}"] if self.resumes else []
        if self.running:
            parts.append("running")
        elif self.killed:
            parts.append(f"stopped without finishing at step {last_step} (killed; saorl train --resume "
                         "continues it)")
        elif self.end is not None and self.end.get("why") not in (None, "done"):
            parts.append(f"ended at step {self.end.get('step')} ({self.end['why']})")
        return "; ".join(parts)


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trainer-step rows of ``metrics.jsonl`` (resume markers applied; the step-0 evaluation
    row left out) and the rows of ``eval.jsonl`` that stand (see the module docstring);
    :class:`NotARunError` when ``run_dir`` is no run."""
    steps, evals, _ = read_history(run_dir)
    return steps, evals


def read_history(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], History]:
    """:func:`read_run` and the run's :class:`History`."""
    paths = RunPaths(run_dir)
    if not run_dir.is_dir():
        raise NotARunError(f"{run_dir} is not a directory; give a run directory that `saorl train` "
                           "wrote (runs/NAME-TIMESTAMP).")
    if not paths.metrics.is_file():
        raise NotARunError(
            f"{run_dir} has no metrics.jsonl, so it is not a saorl run directory (or its run has not "
            "reached its first evaluation yet). Give the directory `saorl train` printed first "
            "(runs/NAME-TIMESTAMP); an experiment's runs are in its runs/ subdirectory.")
    raw = _jsonl(paths.metrics)
    rows = effective_rows(raw)
    steps = [r for r in rows if r.get("step", 0) > 0]
    markers = [r["resume"] for r in raw if isinstance(r.get("resume"), dict)]
    evals = standing_evals(_jsonl(paths.eval) if paths.eval.is_file() else [], markers)
    if not steps and not evals:
        raise NotARunError(f"{paths.metrics} has no trainer step and {run_dir} no evaluation yet: "
                           "nothing to draw. Try again once the run has trained a step.")
    history = History(resumes=[int(m.get("from_step", 0)) for m in markers])
    last_start = max((float(m.get("time", 0)) for m in markers), default=0.0)
    end = _json(paths.end)
    if end is not None and float(end.get("time", 0)) > last_start:  # the last start's, not an earlier one's
        history.end = end
    elif (not paths.end.exists() and paths.stability.is_file()
          and paths.stability.stat().st_mtime > last_start):
        history.end = {}  # a run from before end.json, which ended (stability.json is written at the end)
    if history.end is None:  # (the trainer draws its own run.png at its end, holding the lock)
        try:
            check_not_in_use(run_dir)
        except RunDirError:
            history.running = True
    return steps, evals, history


def standing_evals(evals: list[dict[str, Any]], markers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations that stand, by step: a resume to step S at version V rolls back those
    made before it (version below V) of a step past S, and a step evaluated twice (the step-0
    evaluation of a run resumed without a checkpoint) keeps its newest."""
    for m in markers:
        version, from_step = m.get("version"), int(m.get("from_step", 0))
        if isinstance(version, int):
            evals = [e for e in evals if not (e.get("policy/version", version) < version
                                              and int(e.get("step", 0)) > from_step)]
    by_step = {int(e["step"]): e for e in evals if isinstance(e.get("step"), int)}
    return [by_step[k] for k in sorted(by_step)]


def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict):
            out.append(row)
    return out


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the rows that logged a finite ``key``."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and "step" in r:
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def running_mean(ys: list[float], n: int = SMOOTH) -> list[float]:
    """The mean of each value and the ``n - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the run in ``run_dir`` (see the module docstring) into ``out`` (default
    ``RUN_DIR/run.png``); return the path written."""
    steps, evals, history = read_history(run_dir)
    out = RunPaths(run_dir).plot if out is None else out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True)
    (ax_r, ax_acc, ax_kl), (ax_ev, ax_st, ax_tp) = axes
    last = max([int(r["step"]) for r in steps] + [int(r.get("step", 0)) for r in evals] + [1])

    x, y = series(steps, "reward/mean")
    _curve(ax_r, x, y, "reward/mean", "training reward (batch mean)", smooth=True)

    x, y = series(evals, "eval/accuracy")
    if _curve(ax_acc, x, y, "eval/accuracy", "held-out accuracy", marker="o"):
        best = max(range(len(y)), key=lambda i: (y[i], -x[i]))
        ax_acc.plot([x[best]], [y[best]], "*", color="tab:red", markersize=14,
                    label=f"best {y[best]:.3f} at step {x[best]}")
        ax_acc.annotate(f"last {y[-1]:.3f}", (x[-1], y[-1]), textcoords="offset points", xytext=(-40, -14))
        ax_acc.legend(loc="lower right", fontsize=8)

    x, y = series(steps, "mismatch/kl")
    _curve(ax_kl, x, y, "mismatch/kl", "KL trainer vs sampler / update size", smooth=True)
    ax_kl.set_ylabel("KL")
    x2, y2 = series(steps, "policy/update_rel")
    if x2:
        twin = ax_kl.twinx()
        twin.plot(x2, running_mean(y2), color="tab:purple", linewidth=1.2,
                  label=f"policy/update_rel (mean of {SMOOTH})")
        twin.set_ylabel("relative update size", color="tab:purple")
        twin.legend(loc="upper right", fontsize=8)

    x, y = series(steps, "critic/explained_var")
    _curve(ax_ev, x, y, "critic/explained_var", "critic explained variance", smooth=True)

    x, y = series(steps, "rollout/staleness_mean")
    if _curve(ax_st, x, y, "rollout/staleness_mean", "staleness (policy versions)", smooth=True):
        xm, ym = series(steps, "rollout/staleness_max")
        ax_st.plot(xm, ym, color="tab:gray", linewidth=0.6, alpha=0.6, label="rollout/staleness_max")
        ax_st.legend(loc="upper left", fontsize=8)

    x, y = series(steps, "throughput/action_tokens_per_s")
    _curve(ax_tp, x, y, "throughput/action_tokens_per_s", "throughput (action tokens/s)", smooth=True)
    xi, yi = series(steps, "time/trainer_idle_frac")
    if xi:
        twin = ax_tp.twinx()
        twin.plot(xi, running_mean(yi), color="tab:orange", linewidth=1.0,
                  label=f"time/trainer_idle_frac (mean of {SMOOTH})")
        twin.set_ylim(-0.02, 1.02)
        twin.set_ylabel("trainer idle fraction", color="tab:orange")
        twin.legend(loc="center right", fontsize=8)

    _mark_history(axes, history, last)
    for ax in axes[1]:
        ax.set_xlabel("trainer step")
    for ax in axes.flat:
        ax.set_xlim(-max(0.5, last / 80), last + max(1, last // 40))  # room for the markers at 0 and last
        ax.grid(alpha=0.3)
    what = history.describe(last)
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(steps)} trainer steps, {len(evals)} evaluations"
                 + (f"; {what}" if what else ""), color="tab:red" if history.killed else "black")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _mark_history(axes: Any, history: History, last: int) -> None:
    """A dashed line where each resume went back to; a red one at the last step of a run that
    stopped without finishing."""
    for ax in axes.flat:
        for i, step in enumerate(history.resumes):
            ax.axvline(step, color="tab:green", linestyle="--", linewidth=1.0, alpha=0.8,
                       label=f"resumed from step {step}" if i == 0 else None)
        if history.killed:
            ax.axvline(last, color="tab:red", linewidth=1.4, alpha=0.8, label=f"stopped at step {last}")


def _curve(ax: Any, x: list[int], y: list[float], key: str, title: str, *, smooth: bool = False,
           marker: str | None = None) -> bool:
    """Draw one metric on ``ax`` (raw, and its running mean when ``smooth``); False, with a note on
    the panel, when the run did not log it."""
    ax.set_title(title)
    if not x:
        ax.text(0.5, 0.5, f"{key}\nnot logged by this run", ha="center", va="center",
                transform=ax.transAxes, color="tab:gray")
        return False
    if smooth:
        ax.plot(x, y, color="tab:blue", linewidth=0.6, alpha=0.35, label=key)
        ax.plot(x, running_mean(y), color="tab:blue", linewidth=1.6, label=f"mean of {SMOOTH} steps")
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.plot(x, y, color="tab:blue", linewidth=1.4, marker=marker, markersize=4, label=key)
    return True
