"""``saorl train [CONFIG] [key=value ...] [--resume RUN_DIR [--restart]] [--run-dir DIR]``.

Prints the run directory first and creates it (before the start-up checks, the SFT warm start
and value pretraining, whose caches go under ``run.out_dir/.cache``), then trains; the last line
gives the held-out accuracy of the last step's policy. A start-up problem is one paragraph on
stderr and status 2, and leaves no run directory behind; a run that starts and then fails exits
with status 3 (see :mod:`saorl.errors`), and so does a resume that would restart from step 0
while training is on record that no checkpoint or journal can bring back, unless ``--restart``
asks for that.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from saorl.commands.common import check_env_or_exit, config_or_exit, fail, load_file_or_exit
from saorl.run_paths import RunPaths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
                   help="an optional YAML config, a path or a shipped preset's name such as sao_code_repair "
                        "(default: the built-in SAO on math_tool), then dotted overrides such as "
                        "algo.eps_high=3.0 trainer.steps=50")
    p.add_argument("--resume", metavar="RUN_DIR", type=Path,
                   help="continue a run from its last checkpoint and journal (after a crash or Ctrl-C)")
    p.add_argument("--restart", action="store_true",
                   help="with --resume: when no checkpoint is left, start again from step 0 even though "
                        "trained steps are on record (trained.jsonl, metrics.jsonl, weights/); without it "
                        "such a resume is refused (exit status 3)")
    p.add_argument("--run-dir", type=Path, help="write the run here instead of run.out_dir/NAME-TIMESTAMP")


def run(args: argparse.Namespace) -> int:
    from saorl.runtime.rundir import check_not_in_use, check_run_dir, new_run_dir
    from saorl.stages.env_check import prepare_tasks

    rank0 = int(os.environ.get("RANK", "0")) == 0  # a sharded trainer's other ranks: rank 0 reports
    if args.restart and args.resume is None:
        fail("saorl train: --restart goes with --resume RUN_DIR (it restarts that run from step 0)")
    if args.resume is not None:
        if args.args and "=" not in args.args[0]:
            fail("saorl train: --resume takes its config from the run directory; give only overrides")
        resolved = RunPaths(args.resume).config
        if not resolved.exists():
            fail(f"saorl train: {resolved} not found; is {args.resume} a saorl run directory?")
    given = args.resume or args.run_dir
    if given is not None and rank0:  # one in use, or an old run for a fresh one: refused before
        check_not_in_use(given)      # the seconds of importing the trainer (train() checks again)
        check_run_dir(given, resume=args.resume is not None)
    if args.resume is not None:
        cfg = load_file_or_exit(str(resolved), list(args.args))
    else:
        cfg = config_or_exit("saorl train", list(args.args))
    run_dir = given or new_run_dir(cfg)
    if rank0:
        print(f"run directory: {run_dir}", flush=True)
    try:
        check_env_or_exit("saorl train", cfg)  # before torch is imported: a typo costs well under a second
        prepare_tasks(cfg)  # a recipe's generated data, made on first use (env.prepare)
        from saorl.training import train

        run_dir, final = train(cfg, run_dir, resume=args.resume is not None, restart=args.restart)
    except BaseException:
        if rank0 and args.resume is None and not Path(run_dir).exists():  # announced, then not kept
            print(f"run directory: {run_dir} not kept (the run did not start)", flush=True)
        raise
    if final and run_dir is not None:
        print(last_line(run_dir, final))
    return 0


def last_line(run_dir: Path, final: dict) -> str:
    """The run's last line: the held-out accuracy of the last step's policy (the exported one) and
    the best evaluation, then the reward of the last training batch (a few trajectories)."""
    from saorl.runtime.recorder import best_of, evaluations

    step = final.get("step")
    evals = evaluations(RunPaths(run_dir).eval)
    best = best_of(evals)
    acc = final.get("eval/accuracy")
    if acc is not None:
        head = f"last step {step}: held-out accuracy {acc:.3f}"
        if best is not None:
            head += f" (best {best[0]:.3f} at step {best[1]})"
    elif evals:
        head = (f"last step {step}: not evaluated (stopped early); the last evaluation gave accuracy "
                f"{evals[-1][1]:.3f} at step {evals[-1][0]}")
    else:
        head = f"last step {step}: no held-out evaluation (run.eval_tasks=0)"
    reward = final.get("reward/mean", float("nan"))
    n = final.get("rollout/trained")
    batch = f" of its {int(n)} trajectories" if n is not None else ""
    return f"{head}; training reward{batch} {reward:.3f}"
