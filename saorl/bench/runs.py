"""One benchmark run of the real training loop, and the figures read back from its run directory.

:func:`run_once` is :func:`saorl.training.train` (whose wall-clock budget starts once the rollout
workers are ready) with a :class:`RolloutRecorder` as its observer: it is told of every
dispatched rollout and every batch of finished trajectories (before training), and writes
``rollouts.jsonl`` into the run directory: every finished trajectory (rid, worker, wall-clock
start and end, action tokens) and every rollout dispatched but not finished at the end. The
runtime's own ``trained.jsonl`` only covers trajectories that were trained on, and its journal
is pruned by the final checkpoint.

:func:`analyse` computes, over the **measurement window** ``[first rollout start, last
training end]`` (worker start-up and the step-0 evaluation are excluded; both modes alike):

- trained action tokens / s and trajectories / s = what the steps in the window trained / window;
- trainer idle fraction = Σ ``time/wait_s`` of steps 2..n (time blocked in ``next_batch``; the
  first step's wait includes start-up) / ``[train start of step 1, last train end]``; without
  ``metrics.jsonl`` the gaps between consecutive training intervals are used (these include
  weight publication, so they overstate idleness slightly);
- decode-slot utilisation = busy slot-seconds / (slots × window), slots = workers × engine
  slots; busy slot-seconds = ∫ min(rollouts in flight, slots) dt, a rollout being in flight from
  its start to its end (its turns, prefills and env steps; one still running at the end counts
  from its dispatch to the window's end). This is occupancy in time, unlike the engine's
  ``utilisation`` (busy rows per decode step), which ignores time with no decode step. All
  workers are pooled (the recorder does not know an unfinished rollout's worker), which
  overstates utilisation only if the workers are unevenly loaded;
- staleness of each trained trajectory = (trainer version at its step = step − 1) − the oldest
  version of its action tokens; mean, p50, p90, max;
- positions per action token = the positions the trainer's model passes processed per trained
  action token (``throughput/positions_per_action_token`` of each step, weighted by the step's
  action tokens): 1 + prompt and observation tokens, plus any padding.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from saorl.config import SaorlConfig
from saorl.data.jsonl import read_jsonl
from saorl.run_paths import RunPaths
from saorl.runtime.observe import Observer


class RolloutRecorder(Observer):
    """Writes ``rollouts.jsonl``: ``{"rid", "worker", "t_start", "t_end", "tokens"}`` per finished
    rollout and ``{"rid", "t_submit", "unfinished": true}`` for those never finished."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.submitted: dict[int, float] = {}
        self.rows: list[dict] = []

    def rollout_dispatched(self, rid: int, t: float) -> None:
        self.submitted.setdefault(rid, t)

    def rollouts_finished(self, trajectories) -> None:
        for traj in trajectories:
            ep = traj.episode
            self.submitted.pop(ep.rid, None)
            self.rows.append({"rid": ep.rid, "worker": ep.worker, "t_start": ep.t_start, "t_end": ep.t_end,
                              "tokens": traj.num_action_tokens})

    def run_finished(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
            for rid, t in sorted(self.submitted.items()):
                f.write(json.dumps({"rid": rid, "t_submit": t, "unfinished": True}) + "\n")


def model_files(run_dir: Path) -> list[Path]:
    """What a run writes that a measurement never reads: the final model, the resume checkpoint,
    the published weight versions (5.8 GB for one SmolLM2 run, three in a ``--sync-sao`` bench)."""
    paths = RunPaths(run_dir)
    return [paths.final, paths.checkpoints, paths.weights]


def run_once(cfg: SaorlConfig, run_dir: Path) -> dict:
    """Run ``cfg`` to its wall-clock budget in ``run_dir`` with the recorder on; the last metrics.
    A run directory left by an earlier benchmark is replaced: a measurement is one fresh run.
    The model files (:func:`model_files`) are deleted once the run ends; the logs stay."""
    from saorl.training import train

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    try:
        return train(cfg, run_dir, observer=RolloutRecorder(run_dir / "rollouts.jsonl"))[1]
    finally:
        for path in model_files(run_dir):
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class RunStats:
    window_s: float
    steps: int
    trained_tokens: int
    trained_trajectories: int
    tokens_per_s: float
    trajectories_per_s: float
    trainer_idle_frac: float
    slot_util: float
    engine_step_util: float
    staleness_mean: float
    staleness_p50: float
    staleness_p90: float
    staleness_max: int
    positions_per_action_token: float

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a non-empty list, ``q`` in [0, 100]."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _trainer_idle(trained: list[dict], metrics: list[dict]) -> float:
    if len(trained) < 2:
        return float("nan")
    span = trained[-1]["train_end"] - trained[0]["train_start"]
    by_step = {m.get("step"): m["time/wait_s"] for m in metrics if "time/wait_s" in m}
    waits = [by_step[row["step"]] for row in trained[1:] if row["step"] in by_step]
    if len(waits) != len(trained) - 1:  # no metrics: gaps between training intervals
        waits = [b["train_start"] - a["train_end"] for a, b in itertools.pairwise(trained)]
    return sum(max(0.0, w) for w in waits) / span if span > 0 else float("nan")


def slot_busy_seconds(rollouts: list[dict], t0: float, t1: float, slots: int) -> float:
    """Busy slot-seconds inside ``[t0, t1]``: the integral of ``min(rollouts in flight, slots)``.

    A finished rollout is in flight from its start to its end, an unfinished one from its
    dispatch to ``t1``. The cap matters when workers hold more episodes than decode slots (a
    backlog in the engine's queue): the engine admits a waiting episode the moment a slot frees.
    """
    events: list[tuple[float, int]] = []
    for r in rollouts:
        start, end = (r["t_submit"], t1) if r.get("unfinished") else (r["t_start"], r["t_end"])
        if start is None or end is None:
            continue
        start, end = max(start, t0), min(end, t1)
        if end > start:
            events += [(start, 1), (end, -1)]
    events.sort()
    busy, n, prev = 0.0, 0, t0
    for t, d in events:
        busy += min(n, slots) * (t - prev)
        n, prev = n + d, t
    return busy


def analyse(run_dir: Path, slots: int) -> RunStats:
    """The figures of one run (see the module docstring); ``slots`` = workers × engine slots."""
    paths = RunPaths(run_dir)
    trained = read_jsonl(paths.trained)
    if not trained:
        raise ValueError(f"{run_dir}: no training step in trained.jsonl; raise the budget (--budget-s)")
    metrics = read_jsonl(paths.metrics)
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    starts = [s for row in trained for s in row["rollout_start"] if s is not None]
    starts += [r["t_start"] for r in rollouts if r.get("t_start") is not None]
    t0, t1 = min(starts), max(row["train_end"] for row in trained)
    window = t1 - t0
    tokens = sum(sum(row["action_tokens"]) for row in trained)
    n_traj = sum(len(row["rids"]) for row in trained)
    if not rollouts:  # a trained.jsonl alone: its rollouts are all we know of
        rollouts = [{"t_start": s, "t_end": e} for row in trained
                    for s, e in zip(row["rollout_start"], row["rollout_end"])]
    stale = [float(row["step"] - 1 - min(v)) for row in trained for v in row["versions"] if v]
    stale = stale or [0.0]
    engine_util = next((m["rollout/slot_util"] for m in reversed(metrics) if "rollout/slot_util" in m),
                       float("nan"))
    ratio = {m["step"]: m["throughput/positions_per_action_token"] for m in metrics
             if "throughput/positions_per_action_token" in m}
    weighted = [(ratio[row["step"]], sum(row["action_tokens"])) for row in trained if row["step"] in ratio]
    positions = (sum(r * n for r, n in weighted) / sum(n for _, n in weighted)
                 if weighted and sum(n for _, n in weighted) else float("nan"))
    return RunStats(
        window_s=window, steps=len(trained), trained_tokens=tokens, trained_trajectories=n_traj,
        tokens_per_s=tokens / window, trajectories_per_s=n_traj / window,
        trainer_idle_frac=_trainer_idle(trained, metrics),
        slot_util=slot_busy_seconds(rollouts, t0, t1, slots) / (slots * window),
        engine_step_util=engine_util, staleness_mean=statistics.fmean(stale),
        staleness_p50=percentile(stale, 50), staleness_p90=percentile(stale, 90),
        staleness_max=int(max(stale)), positions_per_action_token=positions)
