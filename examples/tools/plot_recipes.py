"""Plot the calculator recipes' runs (docs/agents.md): one panel per recipe, a line per seed.

Each GROUP is a directory of run directories (``runs/tools/s0``, ``runs/tools/s1``, ...): the
held-out accuracy of each evaluation (``eval/accuracy`` in ``metrics.jsonl``; step 0 is the model
the run started from) against the trainer step, solid with markers, and the training reward of
each step's batch, dotted. A dashed grey line at ``--before`` marks the model before the SFT.
``--minutes`` puts the minutes into the RL loop (``time/elapsed_s``; 0 at the step-0 evaluation)
on the x axis instead of the step. ``--parts A B`` draws runs of several environments (``env.mix``)
with one panel per part and group: the part's held-out accuracy (``eval/<part>/accuracy``) and
training reward (``env/<part>/reward``).

    python examples/tools/plot_recipes.py OUT.png GROUP [GROUP ...] [--titles A B] [--before 0.0]
        [--minutes] [--parts NAME ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(run_dir: Path, minutes: bool = False, part: str | None = None
           ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(held-out accuracy by step, training reward by step) of one run, or of its mix part ``part``;
    by minutes into the RL loop with ``minutes``."""
    acc_key = f"eval/{part}/accuracy" if part else "eval/accuracy"
    reward_key = f"env/{part}/reward" if part else "reward/mean"
    evals, rewards = [], []
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: no metrics.jsonl (is it a run directory?)")
    for line in path.read_text().splitlines():
        r = json.loads(line)
        x = r.get("time/elapsed_s", 0.0) / 60 if minutes else r["step"]
        if acc_key in r:
            evals.append((x, r[acc_key]))
        if reward_key in r:
            rewards.append((x, r[reward_key]))
    if part and not evals:
        raise SystemExit(f"{run_dir}: no {acc_key} in metrics.jsonl (is {part!r} a part of its env.mix?)")
    return evals, rewards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("groups", type=Path, nargs="+")
    p.add_argument("--titles", nargs="+", help="one per group (default: the directories' names)")
    p.add_argument("--before", type=float, default=0.0, help="held-out accuracy before the SFT")
    p.add_argument("--minutes", action="store_true", help="minutes into the RL loop on the x axis, not steps")
    p.add_argument("--parts", nargs="+", help="the env.mix parts to draw, a panel each (per group)")
    args = p.parse_args()
    titles = args.titles or [g.name for g in args.groups]
    if len(titles) != len(args.groups):
        p.error(f"--titles names {len(titles)} groups, {len(args.groups)} were given")
    panels = [(g, t, None) for g, t in zip(args.groups, titles)]
    if args.parts:
        panels = [(g, f"{t}: {part}", part) for g, t in zip(args.groups, titles) for part in args.parts]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), dpi=100,
                             sharey=True, squeeze=False)
    for ax, (group, title, part) in zip(axes[0], panels):
        runs = sorted(d for d in group.iterdir() if (d / "metrics.jsonl").is_file())
        if not runs:
            raise SystemExit(f"{group}: no run directories with a metrics.jsonl")
        for i, run in enumerate(runs):
            evals, rewards = series(run, args.minutes, part)
            color = f"C{i}"
            ax.plot([s for s, _ in evals], [a for _, a in evals], marker="o", color=color,
                    label=f"{run.name}: held-out")
            ax.plot([s for s, _ in rewards], [r for _, r in rewards], linestyle=":", color=color,
                    label=f"{run.name}: training reward")
            at = (lambda x: f"min {x:.1f}") if args.minutes else (lambda x: f"step {x}")
            print(title, run.name, " ".join(f"{at(s)}: {a:.3f}" for s, a in evals))
        ax.axhline(args.before, color="grey", linestyle="--", linewidth=1, label="before the SFT")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes into the RL loop" if args.minutes else "trainer step (0: the SFT model)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    axes[0][0].set_ylabel("accuracy / reward")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
