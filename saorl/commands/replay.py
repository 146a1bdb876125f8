"""``saorl replay RUN_DIR [key=value ...] [--from-step N] [--steps K] [--probe CONTEXT CONTINUATION]``.

Re-runs the learner on the run's exact recorded batches from one of its checkpoints, under the
run's settings with the overrides on top (``trainer.policy_lr=3e-5``, ``algo.eps_high=2``, ...),
and prints the chosen metrics side by side with the run's own, step by step; the rows go to
``RUN_DIR/replays/<time>/replay.jsonl`` (or ``--out``). Unchanged settings reproduce the run's
logged losses and KL. How to use it on a collapse: docs/debugging.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from saorl.commands.common import EXIT_USER, fail
from saorl.run_paths import RunPaths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory to replay")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="settings to change, e.g. trainer.policy_lr=3e-5 (on top of the run's config.yaml)")
    p.add_argument("--from-step", type=int, metavar="N",
                   help="the checkpoint to start from (default: the oldest kept, which replays the most)")
    p.add_argument("--steps", type=int, metavar="K",
                   help="replay at most K steps (default: every recorded one)")
    p.add_argument("--keys", metavar="KEY,KEY",
                   help="metrics to show side by side (default: policy/loss, mismatch/kl, policy/entropy, "
                        "policy/grad_norm, critic/value_loss, advantage/std)")
    p.add_argument("--probe", nargs=2, action="append", default=[], metavar=("CONTEXT", "CONTINUATION"),
                   help="after each step, the policy's probability of CONTINUATION after CONTEXT "
                        "(repeatable)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="where to write replay.jsonl (default: RUN_DIR/replays/<time>)")


def _cell(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.6g}" if isinstance(v, (int, float)) else str(v)


def _row(cells: list[str], widths: list[int]) -> str:
    """One line of the table: each cell right-aligned in its column."""
    return "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()


def run(args: argparse.Namespace) -> int:
    from saorl.atomic import write_text
    from saorl.config import ConfigError, config_to_yaml, load_config
    from saorl.runtime.replay import DEFAULT_KEYS, checkpoint_steps, replay
    from saorl.stages.sft import initial_policy_spec

    run_dir = args.run_dir
    if not RunPaths(run_dir).config.is_file():
        fail(f"saorl replay: {run_dir} is not a run directory (no config.yaml)")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        fail(f"saorl replay: expected key=value overrides after the run directory, got {bad[0]!r}")
    if args.steps is not None and args.steps < 1:
        fail(f"saorl replay: --steps must be >= 1, got {args.steps}")
    try:
        cfg = load_config(RunPaths(run_dir).config, args.overrides)
    except ConfigError as e:
        fail(str(e), EXIT_USER)
    kept = checkpoint_steps(run_dir)
    if args.from_step is None and not kept:
        fail(f"saorl replay: {run_dir} has no checkpoint to start from (run.checkpoint_every)")
    start = args.from_step if args.from_step is not None else kept[0]
    keys = [k.strip() for k in args.keys.split(",")] if args.keys else list(DEFAULT_KEYS)
    head = ["step"] + [f"{k} {side}" for k in keys for side in ("run", "replay")]
    head += [f"probe {i}" for i in range(len(args.probe))]
    print(f"replaying {run_dir} from checkpoint {start}"
          + (f" with {' '.join(args.overrides)}" if args.overrides else " with its own settings"))
    widths = [max(len(h), 12) for h in head]  # a %.6g value is at most 12 characters: columns stay aligned
    print(_row(head, widths))

    out = args.out or RunPaths(run_dir).replays / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    write_text(RunPaths(out).config, config_to_yaml(cfg))  # under the name a run directory gives it
    with open(out / "replay.jsonl", "w", encoding="utf-8") as f:  # row by row: a stop keeps the rows

        def show(row: dict) -> None:
            cells = [str(row["step"])]
            for k in keys:
                cells += [_cell(row["original"], k), _cell(row["replay"], k)]
            cells += [f"{p:.4g}" for p in row["probes"]]
            print(_row(cells, widths), flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()

        rows = replay(cfg, run_dir, start, steps=args.steps, probes=[tuple(p) for p in args.probe],
                      on_step=show, base_policy=initial_policy_spec(cfg) if cfg.model.lora.enabled else None)
    print(f"{len(rows)} steps replayed; rows in {out / 'replay.jsonl'}", file=sys.stderr)
    return 0
