"""Where a run's numbers go: ``metrics.jsonl`` (one line per trainer step), TensorBoard event
files, and a live progress line on the terminal."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

REQUIRED_KEYS = (
    "step", "policy/version", "reward/mean", "policy/dis_kept_frac", "rollout/staleness_mean",
    "rollout/staleness_max", "critic/value_loss", "critic/explained_var", "time/trainer_idle_frac",
    "throughput/trajectories_per_s", "throughput/action_tokens_per_s",
)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a missing value is logged as null
    return v


class MetricsLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, progress: bool = True,
                 total_steps: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:  # tensorboard is a dependency, but a trimmed install still trains
                self._tb = None
        self._progress = None
        if progress and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()
        self.last_eval: dict[str, float] = {}

    def log(self, metrics: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in metrics.items()}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        step = int(metrics["step"])
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(float(v)):
                    self._tb.add_scalar(k, v, step)
        if any(k.startswith("eval/") for k in metrics):
            self.last_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        self._show(metrics)

    def _show(self, m: dict[str, Any]) -> None:
        acc = self.last_eval.get("eval/accuracy")
        info = (f"reward {m.get('reward/mean', float('nan')):.3f} | "
                f"eval acc {'-' if acc is None else f'{acc:.3f}'} | "
                f"stale {m.get('rollout/staleness_mean', 0):.2f} | "
                f"idle {m.get('time/trainer_idle_frac', 0):.0%} | "
                f"{m.get('throughput/action_tokens_per_s', 0):.0f} tok/s")
        if self._progress is not None:
            self._progress.update(self._task, completed=int(m["step"]), info=info)
        else:
            print(f"step {int(m['step'])} | {info}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._f.close()
