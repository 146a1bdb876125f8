"""The experiment report: one Markdown table (one row per arm) and PNG plots, from the run files.

Per arm, over its seeds (``mean ± sd (min–max, n)``; a single seed shows just the value):

- **start acc**: ``eval/accuracy`` at step 0, the SFT model every arm starts from;
- **final acc**: ``eval/accuracy`` of the last evaluation (held-out test split);
- **best acc**: the best evaluation of the run;
- **final reward**: mean ``reward/mean`` (training rollouts) over the last 10% of steps (≥ 1 step);
- **steps**, **wall s**: trainer steps done and wall-clock seconds of the RL loop (``time/elapsed_s``);
- with the ``switches`` plot (online learning): **recover@S** per switch step S, the trainer
  steps after S until the reward, averaged over a trailing window of post-switch steps, is back
  to 80% of its pre-switch level (:func:`recovery_steps`); mean over the seeds that recovered,
  and how many did.

Below the table, :mod:`saorl.experiments.compare` adds the comparisons with 95% t-intervals over
seeds (and paired per-seed differences from a reference arm) and the mechanisms' signals.

Plots average the seeds of an arm on a common x grid (steps; or wall-clock seconds, by linear
interpolation over the time all seeds cover) and shade their min–max.

Resumed runs repeat the steps after their last checkpoint in ``metrics.jsonl``: the last row of a
step wins, and the restarted ``time/elapsed_s`` is shifted so the wall-clock axis keeps going.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from saorl.data.jsonl import read_jsonl
from saorl.experiments.runner import is_finished, run_dir_for
from saorl.run_paths import RunPaths

RECOVERY_FRACTION = 0.8
PRE_WINDOW = 10
"""Steps before a switch whose mean reward is the pre-switch level."""
SMOOTH = 5
"""Trailing window (post-switch steps only) of the smoothed reward in the recovery test."""


@dataclass
class RunData:
    seed: int
    metrics: list[dict]
    """One row per step (deduplicated), with ``wall_s``: monotone seconds since the loop started."""
    evals: list[dict]
    """One row per evaluated step (deduplicated), with ``wall_s`` of that step (0 at step 0)."""


@dataclass
class ArmData:
    name: str
    runs: list[RunData] = field(default_factory=list)


# ------------------------------------------------------------------------------------- loading
def dedupe_metrics(rows: Sequence[dict]) -> list[dict]:
    """Last row per step, in step order, with a monotone ``wall_s`` across resumes."""
    kept: dict[int, dict] = {}
    offset, prev_step = 0.0, 0
    for row in rows:
        if "step" not in row:
            continue
        step = int(row["step"])
        if step <= prev_step and kept:  # a resumed run repeats steps and restarts its clock
            before = kept.get(step - 1)
            offset = before["wall_s"] if before else 0.0
        prev_step = step
        elapsed = row.get("time/elapsed_s")
        kept[step] = dict(row, wall_s=None if elapsed is None else float(elapsed) + offset)
    return [kept[s] for s in sorted(kept)]


def load_run(run_dir: Path, seed: int) -> RunData:
    paths = RunPaths(run_dir)
    metrics = dedupe_metrics(read_jsonl(paths.metrics))
    wall = {r["step"]: r["wall_s"] for r in metrics}
    evals: dict[int, dict] = {}
    for row in read_jsonl(paths.eval):
        step = int(row.get("step", 0))
        evals[step] = dict(row, wall_s=0.0 if step == 0 else wall.get(step))
    return RunData(seed, metrics, [evals[s] for s in sorted(evals)])


def load_arms(out: Path, arms: Sequence[str], seeds: Sequence[int], finished_only: bool = False,
              left_out: list[str] | None = None) -> list[ArmData]:
    """Every arm with the seeds whose run directory exists (missing runs are left out); with
    ``finished_only``, only runs that used their budget (``done.json``): the others' names go
    to ``left_out``, so a table never averages a run cut short with finished ones."""
    data = []
    for arm in arms:
        a = ArmData(arm)
        for seed in seeds:
            d = run_dir_for(out, arm, seed)
            if not d.is_dir():
                continue
            if finished_only and not is_finished(d):
                if left_out is not None:
                    left_out.append(f"{arm}/seed-{seed}")
                continue
            a.runs.append(load_run(d, seed))
        data.append(a)
    return data


# --------------------------------------------------------------------------------- statistics
def fmt_spread(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± sd (min–max, n=N)``; one value: the value; none: ``–``."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "–"
    f = f"{{:.{digits}f}}"
    if len(vals) == 1:
        return f.format(vals[0])
    return (f"{f.format(statistics.fmean(vals))} ± {f.format(statistics.stdev(vals))} "
            f"({f.format(min(vals))}–{f.format(max(vals))}, n={len(vals)})")


def _values(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None]


def final_reward(metrics: Sequence[dict], frac: float = 0.1) -> float | None:
    """Mean ``reward/mean`` over the last ``frac`` of the steps (at least one step)."""
    vals = _values(metrics, "reward/mean")
    if not vals:
        return None
    k = max(1, math.ceil(len(vals) * frac))
    return statistics.fmean(vals[-k:])


def run_summary(run: RunData) -> dict[str, float | None]:
    acc = [(int(r["step"]), float(r["eval/accuracy"])) for r in run.evals
           if r.get("eval/accuracy") is not None]
    start = next((a for s, a in acc if s == 0), None)
    last_wall = next((r["wall_s"] for r in reversed(run.metrics) if r.get("wall_s") is not None), None)
    return {"start_acc": start, "final_acc": acc[-1][1] if acc else None,
            "best_acc": max(a for _, a in acc) if acc else None, "final_reward": final_reward(run.metrics),
            "critic_loss_sd": _sd(_values(run.metrics, "critic/value_loss")),
            "steps": float(run.metrics[-1]["step"]) if run.metrics else 0.0,
            "wall_s": last_wall if last_wall is not None else 0.0}


def _sd(vals: Sequence[float]) -> float | None:
    """Population standard deviation over the steps (how spiky a loss is); None without values."""
    vals = [v for v in vals if math.isfinite(v)]
    return statistics.pstdev(vals) if len(vals) >= 2 else None


def recovery_steps(steps: Sequence[int], rewards: Sequence[float], switches: Sequence[int], *,
                   frac: float = RECOVERY_FRACTION, pre_window: int = PRE_WINDOW,
                   smooth: int = SMOOTH) -> list[int | None]:
    """Trainer steps each switch took to get back to ``frac`` × the pre-switch reward.

    ``steps``/``rewards``: the curve (one reward per trainer step, increasing steps). For a switch
    at step S: ``pre`` = mean reward of the steps in (S − pre_window, S] after the previous switch;
    after S, the smoothed reward at step t is the mean over the post-switch steps in
    (t − smooth, t]. If it never falls below ``frac·pre`` before the next switch, recovery is 0
    steps (the switch cost nothing). Else it is t − S for the first t, after it fell, where it is
    back at ``frac·pre``; None if that does not happen before the next switch (or the end).
    Rewards logged just after S may still come from rollouts sampled before it (async lag); the
    fall-then-rise rule keeps them from counting as an instant recovery.
    """
    out: list[int | None] = []
    bounds = [*switches, math.inf]
    for i, s in enumerate(switches):
        prev = switches[i - 1] if i else -math.inf
        pre = [r for t, r in zip(steps, rewards) if max(prev, s - pre_window) < t <= s]
        post = [(t, r) for t, r in zip(steps, rewards) if s < t <= bounds[i + 1]]
        if not pre or not post:
            out.append(None)
            continue
        target = frac * statistics.fmean(pre)
        fell, result = False, None
        for j, (t, _) in enumerate(post):
            window = [r for u, r in post[: j + 1] if u > t - smooth]
            level = statistics.fmean(window)
            if level < target:
                fell = True
            elif fell:
                result = t - s
                break
        out.append(result if fell else 0)
    return out


def arm_recovery(arm: ArmData, switches: Sequence[int]) -> list[list[int | None]]:
    """Per switch, the recovery steps of each seed."""
    per_seed = []
    for run in arm.runs:
        pts = [(int(r["step"]), float(r["reward/mean"])) for r in run.metrics
               if r.get("reward/mean") is not None]
        per_seed.append(recovery_steps([p[0] for p in pts], [p[1] for p in pts], switches))
    return [[seed_vals[i] for seed_vals in per_seed] for i in range(len(switches))]


def fmt_recovery(values: Sequence[int | None]) -> str:
    got = [v for v in values if v is not None]
    if not values:
        return "–"
    if not got:
        return f"not recovered (0/{len(values)})"
    mean = statistics.fmean(got)
    return f"{mean:.1f} ({len(got)}/{len(values)})" if len(values) > 1 else f"{got[0]}"


# ---------------------------------------------------------------------------------------- table
COLUMNS = (("start acc", "start_acc"), ("final acc", "final_acc"), ("best acc", "best_acc"),
           ("final reward", "final_reward"), ("critic loss sd", "critic_loss_sd"), ("steps", "steps"),
           ("wall s", "wall_s"))


def table_rows(arms: Sequence[ArmData], switches: Sequence[int] = ()) -> list[list[str]]:
    """One row per arm with runs: arm, seeds, the :data:`COLUMNS`, then recover@S per switch."""
    rows = []
    for arm in arms:
        if not arm.runs:
            continue
        sums = [run_summary(r) for r in arm.runs]
        row = [arm.name, str(len(arm.runs))]
        for _, key in COLUMNS:
            digits = 0 if key in ("steps", "wall_s") else 3
            row.append(fmt_spread([s[key] for s in sums], digits))
        if switches:
            row += [fmt_recovery(v) for v in arm_recovery(arm, switches)]
        rows.append(row)
    return rows


def markdown_table(arms: Sequence[ArmData], switches: Sequence[int] = ()) -> str:
    header = ["arm", "seeds", *(c for c, _ in COLUMNS), *(f"recover@{s}" for s in switches)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(arms, switches)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plots
PLOTS = {  # plot name -> [(metric key, file from, y label)]
    "accuracy": [("eval/accuracy", "evals", "test accuracy")],
    "reward": [("reward/mean", "metrics", "train reward (mean per step)")],
    "value_loss": [("critic/value_loss", "metrics", "critic value loss")],
    "dis_kept_frac": [("policy/dis_kept_frac", "metrics", "DIS kept fraction")],
    "staleness": [("rollout/staleness_mean", "metrics", "staleness (versions, mean)")],
    "entropy": [("policy/entropy", "metrics", "policy entropy (nats/token)")],
    "mismatch_kl": [("mismatch/kl_s0", "metrics", "KL(rollout || trainer) at staleness 0"),
                    ("mismatch/kl", "metrics", "KL(rollout || trainer), all tokens")],
    "explained_var": [("critic/explained_var", "metrics", "critic explained variance (before update)")],
    "first_token_adv": [("adv/first_token_std", "metrics", "first-action advantage std over the batch")],
    "grad_norm": [("policy/grad_norm", "metrics", "policy gradient norm (before clipping)")],
    "matched_preferred": [("env/matched_preferred", "metrics", "samples in the rewarded style")],
}


def _series(run: RunData, key: str, source: str, x: str) -> tuple[list[float], list[float]]:
    rows = run.evals if source == "evals" else run.metrics
    xkey = "step" if x == "step" else "wall_s"
    pts = [(float(r[xkey]), float(r[key])) for r in rows
           if r.get(key) is not None and r.get(xkey) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def smooth(ys: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def mean_curve(curves: Sequence[tuple[Sequence[float], Sequence[float]]]):
    """Seeds on one grid: (x, mean, min, max) over the x range every curve covers (numpy arrays)."""
    import numpy as np

    curves = [(np.asarray(x), np.asarray(y)) for x, y in curves if len(x)]
    if not curves:
        return None
    end = min(x[-1] for x, _ in curves)
    grid = np.unique(np.concatenate([x[x <= end] for x, _ in curves]))
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot_metric(arms: Sequence[ArmData], key: str, source: str, x: str, path: Path, ylabel: str, *,
                hlines: dict[str, float] | None = None, vlines: Sequence[int] = ()) -> bool:
    """One line per arm (seeds averaged, min–max shaded); False (nothing written) without data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for i, arm in enumerate(arms):
        curves = [_series(r, key, source, x) for r in arm.runs]
        if source == "metrics":
            curves = [(xs, smooth(ys, max(1, len(ys) // 20))) for xs, ys in curves]
        mc = mean_curve(curves)
        if mc is None:
            continue
        grid, mean, lo, hi = mc
        color = f"C{i % 10}"
        ax.plot(grid, mean, color=color, label=arm.name, marker="o" if len(grid) <= 12 else None, ms=3)
        if len(arm.runs) > 1:
            ax.fill_between(grid, lo, hi, color=color, alpha=0.2)
        drawn = True
    for j, (name, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, color="gray", ls="--" if j == 0 else ":", lw=1, label=name)
    for k, s in enumerate(vlines):
        ax.axvline(s, color="black", ls=":", lw=1, label="style switch" if k == 0 else None)
    if drawn:
        ax.set_xlabel("trainer step" if x == "step" else "wall-clock seconds (RL loop)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def draw_plots(arms: Sequence[ArmData], wanted: Sequence[str], plot_dir: Path, *,
               start_arm: str | None = None, switches: Sequence[int] = ()) -> list[Path]:
    """The PNGs ``wanted`` asks for (each vs steps and vs wall clock); returns the files written."""
    trained = [a for a in arms if a.name != start_arm]
    start = next((a for a in arms if a.name == start_arm and a.runs), None)
    hlines = None
    if start is not None:
        accs = [v for r in start.runs for v in _series(r, "eval/accuracy", "evals", "step")[1]]
        hlines = {f"{start_arm} (start)": statistics.fmean(accs)} if accs else None
    written = []
    for name in wanted:
        if name == "switches":
            path = plot_dir / "reward_switches_vs_steps.png"
            if plot_metric(trained, "reward/mean", "metrics", "step", path, "train reward", vlines=switches):
                written.append(path)
            continue
        for i, (key, source, ylabel) in enumerate(PLOTS[name]):
            stem = name if i == 0 else f"{name}_{key.rsplit('/', 1)[-1]}"  # a plot's further metrics
            for x in ("step", "wall"):
                path = plot_dir / f"{stem}_vs_{'steps' if x == 'step' else 'wall'}.png"
                lines = hlines if name == "accuracy" else None
                if plot_metric(trained, key, source, x, path, ylabel, hlines=lines):
                    written.append(path)
    return written


def comparison_sections(arms: Sequence[ArmData], reference: str | None, start_arm: str | None) -> list[str]:
    """The report's "Comparisons" and "Signals" sections (:mod:`saorl.experiments.compare`)."""
    from saorl.experiments.compare import COLLAPSE_MIN_STEPS, comparison_table, signal_table

    trained = [a for a in arms if a.runs and a.name != start_arm]
    if not trained:
        return []
    ref = reference if any(a.name == reference for a in trained) else trained[0].name
    per_arm = {a.name: {r.seed: run_summary(r) for r in a.runs} for a in trained}
    return ["## Comparisons (95% t-intervals over seeds)", "",
            f"Each cell: the mean over seeds [95% t-interval]; `− {ref}`: the mean per-seed difference from "
            f"the reference arm `{ref}` (paired by seed) [95% t-interval], `*` where it excludes 0.", "",
            comparison_table(per_arm, ref), "",
            "## Signals of the mechanisms (per run over its steps, then 95% t-interval over seeds)", "",
            signal_table({a.name: [r.metrics for r in a.runs] for a in trained}), "",
            "staleness, KL, outside band, DIS kept, clip frac, critic EV, advantage spreads: means over the "
            "steps; outside-band weight: those tokens' share of the uncorrected gradient's weight |r·A| "
            "(mean over the steps); KL s0: staleness-0 tokens only (engine/trainer mismatch alone), weighted "
            "by their count "
            "(s0 tokens/step); entropy: mean over the first / last 10% of steps; grad-norm max/median: the "
            "run's largest policy gradient norm over the median of its non-zero ones; zero-grad steps: the "
            "share of steps with no gradient (all advantages 0); collapsed: the share of seeds whose run "
            "ended with its training reward 0 on every step of a final stretch of at least "
            f"{COLLAPSE_MIN_STEPS} steps after a rewarded one; collapse step: where those began.", "",
            *stability_section(trained, ref)]


def stability_section(trained: Sequence[ArmData], ref: str) -> list[str]:
    """The report's "Stability" section: :mod:`saorl.experiments.stability`'s signals of every run
    over the first S steps, S = the fewest any run took (arms at equal trainer steps)."""
    from saorl.experiments.stability import DRIFT_KL, WINDOW, stability_table, stability_values

    steps = min((int(r.metrics[-1]["step"]) for a in trained for r in a.runs if r.metrics), default=0)
    if steps <= 0:
        return []
    runs = [r for a in trained for r in a.runs]
    at = sorted(set.intersection(*({int(e["step"]) for e in r.evals if 0 < int(e["step"]) <= steps}
                                   for r in runs)) | {steps})  # every evaluation all runs share
    per_arm = {a.name: {r.seed: stability_values(r.metrics, r.evals, steps=steps, at=at)
                        for r in a.runs} for a in trained}
    return [f"## Stability at equal trainer steps (the first {steps}, the fewest any run took)", "",
            stability_table(per_arm, ref), "",
            f"drift bursts: the share of steps with KL(rollout ‖ trainer) on the trained tokens "
            f"(`mismatch/kl`) above {DRIFT_KL:g}; max {WINDOW}-step KL: its largest mean over {WINDOW} "
            "consecutive steps; reward AUC: the mean training reward over the steps (the area under the "
            f"curve per step); update rel: the mean ‖Δθ‖/‖θ‖ of the policy per step; acc@S: test "
            f"accuracy at the last evaluation at or before step S, for S = {steps} and every earlier "
            "evaluated step all runs share. Each: mean over seeds [95% t-interval] "
            f"and the paired difference from `{ref}` (`*`: the interval excludes 0). collapsed: runs that "
            "ended collapsed, with the exact (Clopper–Pearson) 95% interval of the rate, and Fisher's exact "
            f"test against `{ref}`: with a handful of seeds a count is no verdict.", ""]


def write_report(out: Path, title: str, description: str, arms: Sequence[ArmData], wanted: Sequence[str], *,
                 start_arm: str | None = None, switches: Sequence[int] = (), note: str = "",
                 reference: str | None = None, verdicts: bool = False,
                 wall_marks: Sequence[float] = ()) -> Path:
    """``OUT/report.md`` (table, comparisons with confidence intervals against ``reference``,
    signals, plots; with ``verdicts``, :mod:`saorl.experiments.verdicts`' sections, accuracy at
    ``wall_marks`` seconds included) and ``OUT/plots/*.png``; returns the report's path."""
    import json

    sw = [s for s in switches if s > 0] if "switches" in wanted else []
    plots = draw_plots(arms, wanted, out / "plots", start_arm=start_arm, switches=sw)
    table = markdown_table(arms, sw)
    lines = [f"# Experiment: {title}", "", description.strip(), "", note.strip(), "", table, "",
             "Cells: mean ± sd over seeds (min–max, n); one seed: its value. Accuracy: held-out test split "
             "(`eval/accuracy`); final reward: training reward over the last 10% of steps; critic loss sd: "
             "standard deviation of the critic's value loss over the steps (how spiky it is)."]
    if sw:
        lines.append(f"recover@S: trainer steps after the switch at S until the reward (trailing mean of "
                     f"{SMOOTH} post-switch steps) is back to {RECOVERY_FRACTION:.0%} of its level over the "
                     f"{PRE_WINDOW} steps before S; mean over the seeds that recovered (recovered/seeds).")
    lines += ["", *comparison_sections(arms, reference, start_arm)]
    trained = [a for a in arms if a.runs and a.name != start_arm]
    if verdicts and trained:
        from saorl.experiments.verdicts import arm_section, verdict_section

        ref = reference if any(a.name == reference for a in trained) else trained[0].name
        lines += [*verdict_section(trained, ref, wall_marks), *arm_section(trained)]
    lines += ["", *(f"![{p.stem}](plots/{p.name})" for p in plots), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    from saorl.experiments.compare import signal_values

    summary = {a.name: [dict(seed=r.seed, **run_summary(r), signals=signal_values(r.metrics)) for r in a.runs]
               for a in arms}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path
