"""``bench_tta.py``'s evaluation: every snapshot turned into a model directory and scored by one
evaluator (:mod:`tta_eval`; calc's plays its turns itself), the report written, and the same again
from what a benchmark left on disk (``--evaluate OUT``, ``--report OUT``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import tta_eval  # noqa: E402
from tta_setup import TASKS, Setup  # noqa: E402


def checkpoint_dir(s: Setup, arm_dir: Path, snap: dict) -> Path:
    """The snapshot as a transformers model directory (saorl's published state dict over the base
    model's config; TRL's is one already); the base model itself when no weights were produced yet."""
    if snap["weights"] is None:
        return Path(s.model)
    path = arm_dir / snap["weights"]
    if path.is_dir():
        return path
    ckpt = arm_dir / f"ckpt-{snap['fraction']:g}"
    if ckpt.is_dir() and not path.exists():  # converted by an earlier evaluation (--evaluate)
        return ckpt
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
    model.load_state_dict(load_file(str(path)), strict=True)
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(s.model).save_pretrained(ckpt)
    path.unlink()
    return ckpt


def _key(arm: str, seed: int, fraction: float) -> tuple[str, int, float]:
    return arm, int(seed), float(fraction)


def _started_at(out: Path) -> float:
    """The evaluator's temperature the benchmark in ``out`` was started with (for rows written before
    ``base.json`` said its own)."""
    path = out / "arms.json"
    if not path.is_file():
        return 0.0
    return float(json.loads(path.read_text())["meta"].get("eval_temperature") or 0.0)


def scored_before(out: Path, temperature: float) -> tuple[dict | None, dict[tuple, dict]]:
    """The base row and snapshot rows an earlier evaluation of ``out`` at ``temperature`` wrote
    (``base.json``, ``results.jsonl``), to be kept rather than scored again; none at another
    temperature or without its base row."""
    base_path, rows_path = out / "base.json", out / "results.jsonl"
    if not base_path.is_file():
        return None, {}
    base = json.loads(base_path.read_text())
    if float(base.get("eval_temperature", _started_at(out))) != float(temperature):
        return None, {}
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()] \
        if rows_path.is_file() else []
    return base, {_key(r["arm"], r["seed"], r["fraction"]): r for r in rows}


def evaluate_all(s: Setup, out: Path, runs: list[dict], test_rows: list[dict],
                 keep: bool = False, resume: bool = False) -> tuple[dict, list[dict]]:
    """The base model and every snapshot through :func:`tta_eval.evaluate`; rows into results.jsonl
    (each flushed as it is scored; ``base.json`` says the decoding). A snapshot before the budget's
    end is deleted once scored, unless ``keep`` (SmolLM2: 540 MB each). ``resume``: the rows an
    earlier evaluation at the same temperature wrote are kept, only the others are scored."""
    gen_dir = out / "generations"
    gen_dir.mkdir(exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)  # a finished evaluation's, no longer this one's

    task = TASKS[s.task]
    flag = f"{task.FLAG}_frac"

    def score(ckpt: Path, name: str) -> tuple[float, float, str]:
        gens = task.evaluate(ckpt, test_rows, s.chat, s.max_new, temperature=s.eval_temperature, seed=0)
        path = gen_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(g) + "\n" for g in gens), encoding="utf-8")
        return task.accuracy(gens), sum(g[task.FLAG] for g in gens) / len(gens), str(path)

    base, done = scored_before(out, s.eval_temperature) if resume else (None, {})
    if base is None:
        acc, bare, gens = score(Path(s.model), "base")
        base = {"accuracy": acc, flag: bare, "generations": gens, "eval_temperature": s.eval_temperature}
        (out / "base.json").write_text(json.dumps(base) + "\n", encoding="utf-8")
    rows = []
    # the budget's end first (every arm and seed), then the earlier fractions, latest first: an
    # evaluation cut short has scored the comparison at the end
    order = sorted(((run, snap) for run in runs for snap in run["snapshots"]),
                   key=lambda pair: -pair[1]["fraction"])
    kept = [done[k] for k in (_key(r["arm"], r["seed"], snap["fraction"]) for r, snap in order) if k in done]
    with open(out / "results.jsonl", "w", encoding="utf-8") as fh:
        for row in kept:
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
        fh.flush()
        for run, snap in order:
            if _key(run["arm"], run["seed"], snap["fraction"]) in done:
                continue
            ckpt = checkpoint_dir(s, Path(run["dir"]), snap)
            acc, bare, gens = score(ckpt, f"{run['arm']}-s{run['seed']}-f{snap['fraction']:g}")
            row = {"arm": run["arm"], "seed": run["seed"], "fraction": snap["fraction"], "accuracy": acc,
                   "elapsed_s": snap["elapsed_s"], "steps": snap["steps"], "load": snap.get("load"),
                   flag: bare, "checkpoint": str(ckpt), "generations": gens}
            if not keep and snap["fraction"] < 1 and ckpt.is_relative_to(run["dir"]):
                shutil.rmtree(ckpt)
                row["checkpoint"] = None
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            print(f"[bench-tta] eval {run['arm']} seed {run['seed']} at {snap['elapsed_s']:.0f}s "
                  f"({snap['steps']} steps): {acc:.3f}", flush=True)
    return base, rows


def rebuild_report(out: Path) -> str:
    """``summary.md`` and ``tta.png`` of a finished benchmark, again from its ``results.json``; of an
    evaluation cut short, from the rows it wrote (``results.jsonl``, ``base.json``, ``arms.json``),
    its summary saying how many snapshots it covers. ValueError when neither is there."""
    if (out / "results.json").is_file():
        res = json.loads((out / "results.json").read_text())
        return tta_eval.report(out, res["rows"], res["arms"], res["base"], res["meta"])
    parts = [out / name for name in ("arms.json", "base.json", "results.jsonl")]
    if not all(p.is_file() for p in parts):
        raise ValueError(f"{out / 'results.json'} does not exist, nor an evaluation's rows to report "
                         f"({', '.join(p.name for p in parts)})")
    recorded = json.loads(parts[0].read_text())
    base = json.loads(parts[1].read_text())
    rows = [json.loads(line) for line in parts[2].read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{parts[2]} holds no scored snapshot yet")
    total = sum(len(r["snapshots"]) for r in recorded["runs"])
    runs = [{k: v for k, v in r.items() if k != "snapshots"} for r in recorded["runs"]]
    meta = {**recorded["meta"], "eval_temperature": base.get("eval_temperature", _started_at(out)),
            "partial": f"{len(rows)} of {total} snapshots scored"}
    return tta_eval.report(out, rows, runs, base, meta)


def evaluate_and_report(out: Path, s: Setup, meta: dict, runs: list[dict], test: list[dict],
                        keep: bool, resume: bool = False) -> str:
    """Score the base model and every snapshot of ``runs``, then write the report; its text."""
    base, rows = evaluate_all(s, out, runs, test, keep=keep, resume=resume)
    return tta_eval.report(out, rows, [{k: v for k, v in r.items() if k != "snapshots"} for r in runs], base,
                           {**meta, "eval_temperature": s.eval_temperature})


def evaluate_again(out: Path, temperature: float | None, keep: bool) -> str:
    """``--evaluate OUT``: the evaluation and report of the arms ``OUT/arms.json`` records (every arm
    that finished), at ``temperature`` when given, else at the one the benchmark was started with.
    The rows an earlier evaluation at that temperature wrote are kept (an evaluation cut short goes
    on where it stopped). ValueError names a snapshot still to score whose model is gone (scored and
    removed by an evaluation at another temperature, without ``--keep-checkpoints``)."""
    path = out / "arms.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: is {out} a bench_tta.py --out directory whose arms ran?")
    recorded = json.loads(path.read_text())
    meta, runs = recorded["meta"], recorded["runs"]
    fields = {k: meta[k] for k in Setup.__dataclass_fields__ if k in meta}
    fields["model"] = meta.get("model_dir", fields.get("model"))  # meta's "model" is the name as given
    s = Setup(**{**fields, "eval_temperature": fields.get("eval_temperature", 0.0) if temperature is None
                 else temperature})
    _, done = scored_before(out, s.eval_temperature)
    gone = [f"{r['arm']} seed {r['seed']} at {snap['fraction']:g}" for r in runs for snap in r["snapshots"]
            if _key(r["arm"], r["seed"], snap["fraction"]) not in done
            and snap["weights"] is not None and not (Path(r["dir"]) / snap["weights"]).exists()
            and not (Path(r["dir"]) / f"ckpt-{snap['fraction']:g}").is_dir()]
    if gone:
        raise ValueError(f"the models of {', '.join(gone)} are gone (scored and removed by an earlier "
                         "evaluation: run the benchmark with --keep-checkpoints to evaluate them again)")
    _, test = TASKS[s.task].problems(meta["train_n"], meta["test_n"])
    return evaluate_and_report(out, s, meta, runs, test, keep, resume=True)
