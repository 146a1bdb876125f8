"""Gantt timeline of a run: generation per rollout slot and training steps over wall-clock time.

Input: a run directory's ``trained.jsonl`` (rollout start/end per trained trajectory, worker,
training start/end per step) and, when present, the benchmark's ``rollouts.jsonl`` (every
finished rollout, trained or not, and those still running at the end). Rollouts carry a worker
id but no engine slot, so each worker's rollouts are laid out on lanes greedily (earliest start
first, onto the lowest lane free at that time): with ``concurrent_episodes`` per worker this
needs at most that many lanes, up to clock jitter. A lane is an episode in flight, not an
engine slot: with a backlog, episodes beyond ``rollout.engine.slots`` wait in the engine's queue.
Times are seconds since the first rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from saorl.data.jsonl import read_jsonl
from saorl.run_paths import RunPaths


@dataclass
class Timeline:
    bars: list[tuple[int, float, float, int]]
    """``(lane, start, end, tokens)`` per rollout; lanes are grouped by worker."""
    lane_workers: list[int]
    """Worker of each lane."""
    steps: list[tuple[float, float]]
    """``(start, end)`` per training step."""
    t0: float
    """Wall-clock origin (epoch seconds)."""
    end: float
    """Last training end, seconds since ``t0``."""


def assign_lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Lowest free lane per interval, intervals visited by start (ties by end); ``[s, e)`` semantics."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    lane_end: list[float] = []
    out = [0] * len(intervals)
    for i in order:
        s, e = intervals[i]
        lane = next((k for k, free_at in enumerate(lane_end) if free_at <= s), len(lane_end))
        if lane == len(lane_end):
            lane_end.append(e)
        else:
            lane_end[lane] = e
        out[i] = lane
    return out


def load_timeline(run_dir: Path) -> Timeline:
    trained = read_jsonl(RunPaths(run_dir).trained)
    if not trained:
        raise ValueError(f"{run_dir}: trained.jsonl is missing or empty")
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    end_wall = max(r["train_end"] for r in trained)
    if rollouts:
        items = [(r.get("worker") or 0, r["t_start"], r["t_end"], r["tokens"]) for r in rollouts
                 if not r.get("unfinished") and r.get("t_start") is not None]
        items += [(-1, r["t_submit"], end_wall, 0) for r in rollouts if r.get("unfinished")]
    else:
        items = [(w or 0, s, e, n) for row in trained for w, s, e, n in
                 zip(row["workers"], row["rollout_start"], row["rollout_end"], row["action_tokens"])
                 if s is not None and e is not None]
    t0 = min(s for _, s, _, _ in items)
    bars, lane_workers = [], []
    for w in sorted({it[0] for it in items}):
        mine = [it for it in items if it[0] == w]
        lanes = assign_lanes([(s, e) for _, s, e, _ in mine])
        base = len(lane_workers)
        lane_workers += [w] * (max(lanes) + 1)
        bars += [(base + lane, s - t0, e - t0, n) for lane, (_, s, e, n) in zip(lanes, mine)]
    steps = [(r["train_start"] - t0, r["train_end"] - t0) for r in trained]
    return Timeline(bars, lane_workers, steps, t0, end_wall - t0)


def plot_timelines(panels: list[tuple[str, Timeline]], path: Path, max_seconds: float | None = None,
                   slots: int | None = None) -> Path:
    """One Gantt panel per ``(title, timeline)``, stacked, written as a PNG to ``path``.

    Lanes are rollouts in flight; with a backlog (more episodes than engine slots) only
    ``slots`` of them decode at a time, marked by a dashed line when ``slots`` is given.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
    horizon = max_seconds or max(tl.end for _, tl in panels)
    for ax, (title, tl) in zip(axes[:, 0], panels):
        n = len(tl.lane_workers)
        for lane, s, e, _ in tl.bars:
            if s < horizon:
                ax.barh(lane, min(e, horizon) - s, left=s, height=0.8, color="tab:blue", alpha=0.75,
                        edgecolor="white", linewidth=0.3)
        for s, e in tl.steps:
            if s < horizon:
                ax.barh(n + 0.6, min(e, horizon) - s, left=s, height=1.0, color="tab:orange")
        if slots is not None and slots < n:
            ax.axhline(slots - 0.5, color="grey", linestyle="--", linewidth=0.8)
        ax.set_yticks([n / 2 - 0.5, n + 0.6], [f"rollouts in flight\n(lanes: {n})", "trainer"])
        ax.set_xlim(0, horizon)
        ax.set_ylim(-0.8, n + 1.4)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("seconds since the first rollout started")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
