"""The learning rate × staleness map of an experiment's runs: a table and a plot.

Reads every finished run under ``OUT/<arm>/seed-<s>/`` (as ``saorl experiment lr_staleness``
writes them), takes each run's algorithm, policy lr and episodes in flight from its own
``config.yaml``, its measured staleness (the mean of ``rollout/staleness_mean`` over its steps)
from ``metrics.jsonl``, and its stability signals over the first S steps (S: the fewest any run
took, so every cell is at equal trainer steps) from :func:`saorl.runtime.run_signals.stability_values`,
with test accuracy at every evaluated step that all runs share. Prints one Markdown row per
arm (its algorithm, in flight, lr): each signal's mean over seeds, and the seeds' min–max where there are
two or more; with ``--png``, draws test accuracy at S, the drift-burst share and the largest 10-step
KL against the lr, one line per algorithm × staleness. The paired intervals against a reference
arm are the experiment report's (``OUT/report.md``); this is the map's compact view.

    python benchmarks/lr_staleness_map.py runs/experiments/lr_staleness --png map.png
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import yaml

from saorl.data.jsonl import read_jsonl
from saorl.experiments.report import dedupe_metrics
from saorl.runtime.run_signals import stability_values

DONE_FILE = "done.json"
SIGNALS = ("reward AUC", "drift bursts", "max 10-step KL", "update rel")


def load_runs(out: Path) -> list[dict]:
    """One dict per finished run: arm, seed, algo, lr, in flight, metrics, evals."""
    runs = []
    for done in sorted(out.glob(f"*/seed-*/{DONE_FILE}")):
        d = done.parent
        cfg = yaml.safe_load((d / "config.yaml").read_text(encoding="utf-8"))
        rollout = cfg["rollout"]
        runs.append({"arm": d.parent.name, "seed": int(d.name.split("-", 1)[1]), "algo": cfg["algo"]["name"],
                     "lr": float(cfg["trainer"]["policy_lr"]),
                     "in_flight": int(rollout["concurrent_episodes"]) * int(rollout["num_workers"]),
                     "metrics": dedupe_metrics(read_jsonl(d / "metrics.jsonl")),
                     "evals": read_jsonl(d / "eval.jsonl")})
    if not runs:
        raise SystemExit(f"no finished runs (*/seed-*/{DONE_FILE}) under {out}")
    return runs


def cells(runs: list[dict]) -> tuple[int, list[int], dict[tuple, dict[str, list[float]]]]:
    """(S, the accuracy steps, (algo, in flight, lr) → signal → one value per seed)."""
    steps = min(int(r["metrics"][-1]["step"]) for r in runs)
    shared = set.intersection(*({int(e["step"]) for e in r["evals"] if 0 < int(e["step"]) <= steps}
                                for r in runs))
    at = sorted(shared | {steps})
    table: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        key = (r["algo"], r["in_flight"], r["lr"], r["arm"])
        values = stability_values(r["metrics"], r["evals"], steps=steps, at=at)
        stale = [float(m["rollout/staleness_mean"]) for m in r["metrics"]
                 if 0 < m["step"] <= steps and m.get("rollout/staleness_mean") is not None]
        values["staleness"] = statistics.fmean(stale) if stale else None
        for name, v in values.items():
            if v is not None:
                table[key][name].append(float(v))
    return steps, at, table


def _cell(vals: list[float], digits: int) -> str:
    if not vals:
        return "–"
    mean = f"{statistics.fmean(vals):.{digits}f}"
    return mean if len(vals) < 2 else f"{mean} ({min(vals):.{digits}f}–{max(vals):.{digits}f})"


def markdown(steps: int, at: list[int], table: dict[tuple, dict]) -> str:
    names = ["staleness", *(f"acc@{s}" for s in at), *SIGNALS]
    header = ["arm", "algo", "in flight", "policy lr", "seeds", *names]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    digits = {"staleness": 1, "max 10-step KL": 4, "update rel": 5}
    for (algo, flight, lr, arm), vals in sorted(table.items()):
        row = [arm, algo, str(flight), f"{lr:g}", str(len(vals["reward AUC"]))]
        row += [_cell(vals.get(n, []), digits.get(n, 3)) for n in names]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(steps: int, table: dict[tuple, dict], path: Path, skip: tuple[str, ...] = ()) -> None:
    """One line per (algo, in flight) across the lr; arms named in ``skip`` left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"acc@{steps}", f"test accuracy at step {steps}"),
              ("drift bursts", "drift bursts (share of steps)"),
              ("max 10-step KL", "max 10-step KL(rollout ‖ trainer)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    lines: dict[tuple, list] = defaultdict(list)
    for (algo, flight, lr, arm), vals in table.items():
        if arm not in skip:
            lines[(algo, flight)].append((lr, vals))
    for ax, (name, label) in zip(axes, panels):
        for (algo, flight), pts in sorted(lines.items()):
            pts = sorted((lr, v) for lr, v in pts if v.get(name))
            xs = [lr for lr, _ in pts]
            ys = [statistics.fmean(v[name]) for _, v in pts]
            err = [[y - min(v[name]) for y, (_, v) in zip(ys, pts)],
                   [max(v[name]) - y for y, (_, v) in zip(ys, pts)]]
            stale = [s for _, v in pts for s in v.get("staleness", [])]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, linestyle="-" if algo == "sao" else "--",
                        label=f"{algo}, {flight} in flight (staleness {statistics.fmean(stale):.1f})")
        ax.set_xscale("log")
        if "KL" in name:  # spans decades across the lr
            ax.set_yscale("log")
        ax.set_xlabel("policy lr")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"lr × staleness on math_tool, first {steps} trainer steps (mean over seeds, min–max bars)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the experiment's output directory")
    p.add_argument("--png", type=Path, help="also draw the map into this PNG")
    p.add_argument("--skip", default="", metavar="A,B",
                   help="arms left out of the plot (e.g. an extra ablation)")
    args = p.parse_args()
    steps, at, table = cells(load_runs(args.out))
    print(f"equal trainer steps: the first {steps}")
    print(markdown(steps, at, table))
    if args.png:
        plot(steps, table, args.png, tuple(a for a in args.skip.split(",") if a))
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
