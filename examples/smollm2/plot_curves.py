"""Plot held-out accuracy against minutes of training for runs of the real-model recipes.

Reads each RUN_DIR's ``metrics.jsonl``: the ``eval/accuracy`` records (step 0 = the pretrained
model) and, for the wall clock, the ``time/elapsed_s`` of the step each evaluation followed (the
seconds since the first step began: the step-0 evaluation and value pretraining before it are not
counted, later evaluations are). One line per run, labelled by its directory name.

    python examples/smollm2/plot_curves.py OUT.png RUN_DIR [RUN_DIR ...] [--labels A B ...] [--title TEXT]
        [--baseline ACC --baseline-label TEXT]   # a dashed line, e.g. the pretrained model before SFT
        [--x step]                               # trainer steps on the x axis instead of minutes

It draws any saorl run, the tiny model's too (docs/guide.md draws the Quick start's runs with it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, minutes of training, held-out accuracy) of each evaluation of the run."""
    elapsed: dict[int, float] = {0: 0.0}
    evals: list[tuple[int, float]] = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "time/elapsed_s" in r:
            elapsed[r["step"]] = r["time/elapsed_s"]
        if "eval/accuracy" in r:
            evals.append((r["step"], r["eval/accuracy"]))
    return [(s, elapsed.get(s, float("nan")) / 60, acc) for s, acc in evals]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--title", default="held-out accuracy")
    p.add_argument("--labels", nargs="+", help="one per run (default: the run directories' names)")
    p.add_argument("--baseline", type=float, help="a held-out accuracy drawn as a dashed line")
    p.add_argument("--baseline-label", default="before", help="its legend entry")
    p.add_argument("--x", choices=("minutes", "step"), default="minutes",
                   help="the x axis: minutes of training (default) or trainer steps")
    p.add_argument("--legend", default="best",
                   help="the legend's place: a matplotlib loc ('lower left', ...) or 'outside' (right of it)")
    args = p.parse_args()
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        p.error(f"--labels names {len(labels)} runs, {len(args.runs)} were given")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for run, label in zip(args.runs, labels):
        points = curve(run)
        xs = [m if args.x == "minutes" else s for s, m, _ in points]
        size = 3 if args.x == "step" else 6
        ax.plot(xs, [a for _, _, a in points], marker="o", markersize=size, label=label)
        if args.x == "minutes":
            for step, m, a in points:
                ax.annotate(f"step {step}", (m, a), textcoords="offset points", xytext=(3, 4), fontsize=7)
        print(label, " ".join(f"step {s}: {a:.3f} ({m:.1f} min)" for s, m, a in points))
    if args.baseline is not None:
        ax.axhline(args.baseline, color="grey", linestyle="--", linewidth=1, label=args.baseline_label)
    minutes = "minutes since step 1 began (2 shared CPU cores)"
    ax.set_xlabel(minutes if args.x == "minutes" else "trainer step")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.03, 1.03)  # a line at 0 or 1 stays visible
    ax.set_title(args.title, fontsize=10)
    ax.grid(alpha=0.3)
    if args.legend == "outside":
        fig.set_size_inches(8, 3.6)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=7, loc=args.legend)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
