"""The rollout worker's memory over many episodes: the local engine's session prefix store.

A rollout worker's local engine keeps each finished request's KV row for its session's next turn
(``saorl.engines.prefix``). The last turn of an episode leaves a row no request will take; the agent
loop ends the session when the episode ends, and the engine drops it. This benchmark builds a
run's rollout worker from a config (its engine, env and tasks, exactly as ``saorl train`` does),
plays ``--episodes`` episodes ``--concurrency`` at a time, and after every round reports the
store's size and the process's RSS, in two fresh processes side by side:

- ``ended``: as saorl runs (the loop ends each episode's session);
- ``open``: the engine's ``end_session`` a no-op, so every episode's last row stays until the
  store's budget (``rollout.engine.prefix_cache_tokens``) evicts it: what saorl did before.

    python benchmarks/bench_prefix_store.py configs/recipes/smollm2_135m_tools.yaml --episodes 192

Extra ``key=value`` arguments override the config, as ``saorl train`` takes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("ended", "open")


def play(config: str, overrides: list[str], arm: str, episodes: int, concurrency: int) -> list[dict]:
    """One arm in this process: a list of rows, one a round."""
    from saorl.agent.loop import run_episodes
    from saorl.config.loading import load_config
    from saorl.engines.kv import kv_per_token
    from saorl.models.codec import run_tokenizer
    from saorl.runtime.backends.worker import build_worker
    from saorl.runtime.memory import status_mib
    from saorl.runtime.parts import build_tasks, worker_spec

    cfg = load_config(config, overrides)
    tokenizer = run_tokenizer(cfg.model)
    with tempfile.TemporaryDirectory() as run_dir:
        spec = worker_spec(cfg, Path(run_dir), cfg.model.policy, tokenizer)
        stack = build_worker(spec)
        engine = stack.engine
        if arm == "open":
            engine.end_session = lambda session: None
        train, _ = build_tasks(cfg, stack.env_factory, tokenizer)
        per_token = kv_per_token(engine.model.config) * next(engine.model.parameters()).element_size()
        rows, played, t0 = [], 0, time.perf_counter()
        try:
            while played < episodes:
                n = min(concurrency, episodes - played)
                tasks = [train[(played + i) % len(train)] for i in range(n)]
                trajs = asyncio.run(run_episodes(engine, stack.env_factory, tasks, stack.tokenizer,
                                                 concurrency=concurrency, sampling=spec.sampling,
                                                 max_total_tokens=spec.max_total_tokens))
                played += n
                s = engine.stats()
                rows.append({"episodes": played, "turns": sum(t.episode.turns for t in trajs),
                             "sessions": int(s["prefix_sessions_held"]),
                             "tokens": int(s["prefix_tokens_held"]),
                             "store_mib": s["prefix_tokens_held"] * per_token / 2**20,
                             "rss_mib": status_mib(os.getpid()), "hwm_mib": status_mib(os.getpid(), "VmHWM"),
                             "seconds": time.perf_counter() - t0})
                print(json.dumps({"arm": arm, **rows[-1]}), file=sys.stderr, flush=True)
        finally:
            engine.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    ap.add_argument("--episodes", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process's one arm
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.concurrency < 1:
        ap.error("--episodes and --concurrency must be >= 1")
    if args.arm:
        print(json.dumps(play(args.config, args.overrides, args.arm, args.episodes, args.concurrency)))
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms must name some of {', '.join(ARMS)}, got {args.arms!r}")
    results = {}
    for arm in arms:  # each in a fresh process: its RSS is its own
        out = subprocess.run([sys.executable, __file__, args.config, *args.overrides, "--arm", arm,
                              "--episodes", str(args.episodes), "--concurrency", str(args.concurrency)],
                             stdout=subprocess.PIPE, text=True)
        if out.returncode:
            sys.exit(f"bench_prefix_store: the {arm!r} arm failed (exit status {out.returncode})")
        results[arm] = json.loads(out.stdout.strip().splitlines()[-1])
    print("| arm | episodes | sessions held | tokens held | store (MiB) | RSS (MiB) | peak RSS (MiB) "
          "| seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arm, rows in results.items():
        for r in rows:
            print(f"| {arm} | {r['episodes']} | {r['sessions']} | {r['tokens']:,} | {r['store_mib']:,.0f} | "
                  f"{r['rss_mib']:,.0f} | {r['hwm_mib']:,.0f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
