"""Score a finished ``bench_tta.py`` run's final models again, sampled instead of greedy.

    python benchmarks/tta_rescore.py runs/measure/tta-calc --temperature 1 --samples 2

A greedy evaluation can sit at its ceiling while the policy still changes: on the calculator task
the SFT start already answers nearly every held-out problem greedily, while its sampled replies
(what the training reward sees) are right half the time. This scores the base model and every snapshot the
run kept (those at the budget's end, unless ``--keep-checkpoints``) on the same held-out problems
with the task's own evaluator at ``--temperature``, ``--samples`` episodes a problem (sample ``k``
seeded ``k``, the same for every model), and writes ``OUT/rescore-tT.jsonl`` (a row per model:
accuracy over its episodes, and per problem) and ``OUT/rescore-tT.md``: each arm's accuracy per
seed and mean, then each arm against TRL and the others against saorl's GRPO, paired by seed, with
95% t-intervals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import tta_eval  # noqa: E402
from bench_tta import TASKS  # noqa: E402


def score(task, ckpt: Path, test: list[dict], chat: bool, max_new: int, temperature: float,
          samples: int) -> dict:
    """Accuracy of ``ckpt`` over ``samples`` sampled episodes of each problem of ``test``."""
    per_problem = [0.0] * len(test)
    for k in range(samples):
        gens = task.evaluate(ckpt, test, chat, max_new, temperature=temperature, seed=k)
        for i, g in enumerate(gens):
            per_problem[i] += float(g["correct"]) / samples
    return {"accuracy": statistics.fmean(per_problem), "per_problem": per_problem}


def table(rows: list[dict], base: float, temperature: float, samples: int, n: int) -> str:
    from saorl.experiments.stats import paired_interval

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    acc = {a: {r["seed"]: r["accuracy"] for r in rows if r["arm"] == a} for a in arms}
    lines = [f"Held-out accuracy sampled at temperature {temperature:g}, {samples} episode(s) on each of "
             f"{n} problems, at the budget's end (base model {base:.3f}):", "",
             "| arm | mean | each seed |", "|---|---:|---|"]
    for a in arms:
        each = ", ".join(f"{acc[a][k]:.3f}" for k in sorted(acc[a]))
        lines.append(f"| {a} | **{statistics.fmean(acc[a].values()):.3f}** | {each} |")
    lines += ["", "| arm − reference | mean difference, 95% t-interval (paired by seed) |", "|---|---|"]
    for a, ref in tta_eval.pairs(arms):
        iv = paired_interval(acc[a], acc[ref])
        lines.append(f"| {a} − {ref} | {'–' if iv is None else iv.fmt(signed=True)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="a finished bench_tta.py --out directory")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=1, help="episodes a problem")
    args = p.parse_args(argv)
    if args.temperature <= 0 or args.samples < 1:
        p.error("--temperature must be > 0 (greedy is the benchmark's own evaluation) and --samples >= 1")
    results = args.out / "results.json"
    if not results.is_file():
        p.error(f"{results} does not exist: is {args.out} a finished bench_tta.py run?")
    res = json.loads(results.read_text())
    meta = res["meta"]
    task = TASKS[meta["task"]]
    _, test = task.problems(meta["train_n"], meta["test_n"])
    last = max(r["fraction"] for r in res["rows"])  # the budget's end: one model per arm and seed
    kept = [r for r in res["rows"] if r["fraction"] == last and r.get("checkpoint")
            and Path(r["checkpoint"]).is_dir()]
    if not kept:
        p.error(f"{args.out} kept no snapshot's model (its checkpoints were removed)")
    tag = f"t{args.temperature:g}"
    print(f"rescoring the base model and {len(kept)} snapshots at temperature {args.temperature:g}, "
          f"{args.samples} episode(s) a problem", flush=True)
    b = score(task, Path(meta["model_dir"]), test, meta["chat"], meta["max_new"], args.temperature,
              args.samples)
    print(f"base: {b['accuracy']:.3f}", flush=True)
    rows = []
    with open(args.out / f"rescore-{tag}.jsonl", "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"arm": "base", "seed": None, **b}) + "\n")
        for r in kept:
            got = score(task, Path(r["checkpoint"]), test, meta["chat"], meta["max_new"], args.temperature,
                        args.samples)
            row = {"arm": r["arm"], "seed": r["seed"], "fraction": r["fraction"], "steps": r["steps"], **got}
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            print(f"{r['arm']} seed {r['seed']} ({r['steps']} steps): {got['accuracy']:.3f}", flush=True)
    text = table(rows, b["accuracy"], args.temperature, args.samples, len(test))
    (args.out / f"rescore-{tag}.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
