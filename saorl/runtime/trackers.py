"""The run's trackers: TensorBoard, Weights & Biases, MLflow, ... through accelerate's tracker
classes (``accelerate.tracking``), beside ``metrics.jsonl``, which the recorder always writes.

``run.report_to`` names them. Each is built with ``run.tracker_project`` as its project (W&B,
Comet, SwanLab, Trackio, Aim, ClearML) or experiment (MLflow), the run directory's name as the run
name where the tracker takes one (W&B, MLflow), and ``run.tracker_options[name]`` as keyword
arguments of its init call (for W&B, those of ``wandb.init``: ``mode: offline``, ``entity``,
``tags``). TensorBoard writes to ``RUN/tb``, W&B under ``RUN/wandb``, MLflow to a SQLite store
in ``RUN/mlflow`` (:func:`_mlflow_store`), unless told otherwise. Each
gets the resolved config once (flattened to dotted keys), then every logged row: the step-0
evaluation and each trainer step, finite scalars only.

Histograms. ``policy/ratio_hist`` holds counts of DIS ratios over fixed log-spaced bins
(:func:`saorl.algo.losses.ratio_histogram`). TensorBoard gets it as a histogram
(``add_histogram_raw``) and W&B as ``wandb.Histogram``, over ``log10(ratio)``, where the bins are
evenly spaced (0 is a ratio of 1); the other trackers have no pre-binned histogram and the counts
stay in ``metrics.jsonl``.

A tracker named but not installed is :class:`TrackerUnavailable`, raised before any stage runs.
A tracker that fails to start (its init raises) is :class:`TrackerFailed`, one paragraph naming
it; the trackers are the last thing a run's start makes, so a start that fails otherwise has
written no tracker files, and a run directory that holds what an earlier tracker wrote is kept
(``TrackerFailed.started``: :func:`saorl.training.train` removes a failed start's directory
only when nothing a tracker wrote is in it).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from saorl.algo.losses import ratio_histogram_edges
from saorl.errors import StartupError

HISTOGRAMS: dict[str, torch.Tensor] = {"policy/ratio_hist": ratio_histogram_edges()}
"""Metric keys that hold histogram counts → their bin edges (``len(counts) + 1``)."""

PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "saorl[wandb]"),
            "mlflow": ("mlflow", "saorl[mlflow]"), "comet_ml": ("comet_ml", "comet-ml"),
            "aim": ("aim", "aim"), "clearml": ("clearml", "clearml"), "dvclive": ("dvclive", "dvclive"),
            "swanlab": ("swanlab", "swanlab"), "trackio": ("trackio", "trackio")}
"""Tracker → (the module it needs, what to ``pip install`` for it)."""


class TrackerUnavailable(RuntimeError):
    """A tracker named in ``run.report_to`` whose package is not installed."""


class TrackerFailed(StartupError):
    """A tracker of ``run.report_to`` that raised as it started; ``started`` names the ones that
    had started before it (their files are in the run directory)."""

    def __init__(self, message: str, started: list[str]) -> None:
        super().__init__(message)
        self.started = started


def check_trackers(names: list[str]) -> None:
    """Raise :class:`TrackerUnavailable` (one paragraph) if a named tracker's package is missing."""
    for name in names:
        module, pip = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise TrackerUnavailable(
                f"run.report_to names {name!r}, but the {module!r} package is not installed: `pip install "
                f"'{pip}'`, or remove {name!r} from run.report_to (metrics.jsonl is always written)")


def flat_config(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists, dicts left and None as JSON text (what every
    tracker's hyperparameter table takes)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flat_config(v, key + ".")
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


class Trackers:
    """The trackers of one run; ``log`` each row, ``close`` at the end."""

    def __init__(self, names: list[str], run_dir: Path, *, project: str = "saorl",
                 options: dict[str, dict[str, Any]] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        check_trackers(names)
        self.trackers: list[Any] = []
        name = ""
        try:
            for name in names:
                tracker = _build(name, Path(run_dir), project, dict((options or {}).get(name, {})))
                if hasattr(tracker, "start"):  # accelerate >= 1.4 opens the tracker here
                    tracker.start()
                self.trackers.append(tracker)
                if config:
                    tracker.store_init_configuration(flat_config(config))
        except Exception as e:
            started = self.names  # the failing one too, if it raised after it started
            self._close_quietly()
            kept = (f" The run directory {run_dir} is kept: it holds what {', '.join(started)} wrote."
                    if started else "")
            raise TrackerFailed(
                f"run.report_to: the {name!r} tracker failed to start: {type(e).__name__}: {e}. Check "
                f"run.tracker_options.{name} (and the tracker's environment variables), or remove {name!r} "
                f"from run.report_to (metrics.jsonl is always written).{kept}", started) from e
        except BaseException:
            self._close_quietly()
            raise

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """The finite scalars of ``metrics`` (``step`` aside), and its histograms as histograms."""
        scalars = {k: v for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))}
        hists = {k: v for k, v in metrics.items() if k in HISTOGRAMS and isinstance(v, (list, tuple))}
        for t in self.trackers:
            if scalars:
                t.log(scalars, step=step)
            for key, counts in hists.items():
                _log_histogram(t, key, [int(c) for c in counts], HISTOGRAMS[key], step)

    def close(self) -> None:
        for t in self.trackers:
            t.finish()
        self.trackers = []

    def _close_quietly(self) -> None:
        """Close what started, after another tracker failed: that failure is the one to report."""
        for t in self.trackers:
            try:
                t.finish()
            except Exception:
                pass
        self.trackers = []


def _build(name: str, run_dir: Path, project: str, options: dict[str, Any]) -> Any:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    cls = LOGGER_TYPE_TO_CLASS[name]
    if name == "tensorboard":
        return cls("tb", str(run_dir), **options)
    if name == "wandb":
        return cls(project, **{"name": run_dir.name, "dir": str(run_dir), **options})
    if name == "mlflow":
        return cls(**{"experiment_name": project, "run_name": run_dir.name,
                      **_mlflow_store(run_dir, options), **options})
    if cls.requires_logging_directory:
        return cls(project, **{"logging_dir": str(run_dir), **options})
    return cls(project, **options)


def _mlflow_store(run_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Where MLflow keeps the run: ``options["tracking_uri"]`` (taken out of the init's keyword
    arguments), else ``MLFLOW_TRACKING_URI``, else a SQLite store in ``RUN/mlflow/mlflow.db`` with
    its artifacts beside it, in ``RUN/mlflow/artifacts`` (MLflow 3 refuses a ``./mlruns`` file
    store, and its own default, ``sqlite:///mlflow.db``, lands in whatever directory the run was
    started from). The keyword arguments for accelerate's tracker: the artifact location."""
    import mlflow

    uri = options.pop("tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        mlflow.set_tracking_uri(uri)
        return {}
    store = run_dir / "mlflow"
    store.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(f"sqlite:///{store.resolve() / 'mlflow.db'}")
    return {"logging_dir": (store / "artifacts").resolve().as_uri()}


def _log_histogram(tracker: Any, key: str, counts: list[int], edges: torch.Tensor, step: int) -> None:
    """One pre-binned histogram over ``log10`` of the bin edges, to TensorBoard or W&B."""
    if len(counts) + 1 != len(edges) or sum(counts) == 0:
        return
    log_edges = [math.log10(float(e)) for e in edges]
    if tracker.name == "tensorboard":
        centres = [(a + b) / 2 for a, b in itertools.pairwise(log_edges)]
        filled = [i for i, c in enumerate(counts) if c]
        tracker.writer.add_histogram_raw(
            key, min=log_edges[filled[0]], max=log_edges[filled[-1] + 1], num=sum(counts),
            sum=sum(c * x for c, x in zip(counts, centres)),
            sum_squares=sum(c * x * x for c, x in zip(counts, centres)),
            bucket_limits=log_edges[1:], bucket_counts=counts, global_step=step)
        tracker.writer.flush()
    elif tracker.name == "wandb":
        import wandb

        tracker.run.log({key: wandb.Histogram(np_histogram=(counts, log_edges))}, step=step)
