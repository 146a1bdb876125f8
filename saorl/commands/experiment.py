"""``saorl experiment NAME|PATH [--quick] [--out DIR] [--seeds N] [--arms a,b] [--jobs N] [key=value ...]``.

Runs every arm × seed of an experiment spec (``configs/experiments/NAME.yaml``) one after another
(``--jobs N``: N at a time, each in a process of its own, :mod:`saorl.experiments.parallel`),
then writes ``OUT/report.md`` (the comparison table and plots) and ``OUT/plots/*.png``. Runs that
finished earlier in ``OUT`` are skipped, so an interrupted experiment resumes where it stopped;
``--report`` only redraws the report from what is there. ``key=value`` overrides apply to every arm
(last). Before anything runs it prints what the full version may cost: arms × seeds × the
wall-clock budget per run (plus the SFT warm start and value pretraining, both cached).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from saorl.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from saorl.experiments.spec import known_experiments

    p.add_argument("experiment", metavar="NAME_OR_PATH",
                   help=f"an experiment name ({', '.join(known_experiments())}) or a spec YAML")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides for every arm, applied last (right after the name)")
    p.add_argument("--quick", action="store_true",
                   help="tiny settings from the spec's quick section (minutes on a laptop CPU)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/experiments/NAME[-quick])")
    p.add_argument("--seeds", type=int, metavar="N", help="run the first N seeds (default: the spec's)")
    p.add_argument("--arms", metavar="A,B", help="comma-separated arms to run (default: all)")
    p.add_argument("--report", action="store_true", help="only write the report from existing runs")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs at once, each in a process of its own (default 1: one after another); with "
                        "N > 1 give each run its share of the cores, e.g. runtime.trainer_threads=1")
    p.add_argument("--run", metavar="ARM:SEED", help=argparse.SUPPRESS)  # one run: a --jobs child


def run(args: argparse.Namespace) -> int:
    from saorl.experiments.plan import cost_lines, switch_steps
    from saorl.experiments.report import load_arms, write_report
    from saorl.experiments.runner import ExperimentInterrupted, ExperimentRunner, Selection
    from saorl.experiments.spec import SpecError, find_spec, load_spec, selected_arms, selected_seeds

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"saorl experiment: expected key=value overrides after the experiment, got {bad[0]!r}",
              file=sys.stderr)
        return 2
    try:
        path = find_spec(args.experiment)
        spec = load_spec(path)
        names = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
        if args.seeds is not None and args.seeds < 1:
            raise SpecError(f"--seeds must be >= 1, got {args.seeds}")
        sel = Selection(selected_arms(spec, args.quick, names), selected_seeds(spec, args.quick, args.seeds),
                        args.quick, list(args.overrides))
        out = args.out or Path("runs") / "experiments" / (spec.name + ("-quick" if args.quick else ""))
        if args.jobs < 1:
            raise SpecError(f"--jobs must be >= 1, got {args.jobs}")
        runner = ExperimentRunner(spec, path, out, sel)
        if args.run is not None:
            return run_child(runner, args.run)
        trained = [a for a in sel.arms if a != spec.start_arm] or [next(iter(spec.arms))]
        cfgs = {a: runner.config(a, sel.seeds[0]) for a in trained}
        cfg = cfgs[trained[0]]
    except (SpecError, ConfigError) as e:
        print(f"saorl experiment: {e}", file=sys.stderr)
        return 2
    print(f"experiment {spec.name}: arms {', '.join(sel.arms)}; seeds {sel.seeds} -> {out}")
    for line in cost_lines(spec, sel.arms, sel.seeds, args.quick,
                           (cfg.trainer.steps, cfg.trainer.max_wall_s)):
        print(line)
    weak = weak_start(spec, path, trained[0], sel, cfg) if args.quick else None
    if weak:
        print(weak)
    status = 0
    if not args.report:
        try:
            from saorl.errors import StartupError
            from saorl.stages.env_check import prepare_tasks
            try:
                prepare_tasks(cfg)  # a recipe's generated task files (env.prepare), before any run
            except StartupError as e:
                print(f"saorl experiment: {e}", file=sys.stderr)
                return 2
            if args.jobs > 1:
                from saorl.experiments.parallel import run_parallel

                run_parallel(runner, str(path.absolute()), args.jobs, debug=getattr(args, "debug", False))
            else:
                runner.run()
        except ExperimentInterrupted as e:
            from saorl.experiments.parallel import ExperimentFailed

            print(f"saorl experiment: {e}", file=sys.stderr)
            status = 1 if isinstance(e, ExperimentFailed) else 130
        except (SpecError, ConfigError) as e:
            print(f"saorl experiment: {e}", file=sys.stderr)
            return 2
    if not out.is_dir():
        print(f"saorl experiment: {out} does not exist: nothing to report (run without --report first)",
              file=sys.stderr)
        return 2
    left_out: list[str] = []
    arms = load_arms(out, sel.arms, sel.seeds, finished_only=True, left_out=left_out)
    mode = "quick" if args.quick else "full"
    def each(value) -> str:  # one value, or each arm's where the arms differ
        got = {a: value(c) for a, c in cfgs.items()}
        if len(set(got.values())) == 1:
            return str(next(iter(got.values())))
        return "by arm (" + ", ".join(f"{a} {v}" for a, v in got.items()) + ")"

    note = (f"Mode: {mode}; {cfg.env.type}; budget {each(lambda c: c.trainer.steps)} steps / "
            f"{each(lambda c: c.trainer.max_wall_s or 'unlimited')} s per run; "
            f"batch {each(lambda c: c.trainer.batch_size)}; "
            f"policy lr {each(lambda c: f'{c.trainer.policy_lr:g}')}; seeds {sel.seeds}.")
    if weak:
        note += (" The SFT start of this quick run is too weak to solve the tasks: its accuracies are "
                 "not meaningful (a smoke test of the pipeline).")
    if left_out:
        note += f" Not finished, left out of the table and plots: {', '.join(left_out)}."
    report = write_report(out, spec.name, spec.description, arms, spec.plots, start_arm=spec.start_arm,
                          switches=switch_steps(cfg) if "switches" in spec.plots else (), note=note,
                          reference=spec.reference_arm(sel.arms), verdicts=spec.verdicts,
                          wall_marks=spec.wall_marks(args.quick))
    print(report.read_text(encoding="utf-8").split("\n\n![", 1)[0])
    print(f"\nreport: {report}")
    return status


def run_child(runner, which: str) -> int:
    """``--run ARM:SEED`` (a ``--jobs`` child, :mod:`saorl.experiments.parallel`): that run alone,
    dying with the parent that started it."""
    from saorl.experiments.parallel import PARENT_ENV
    from saorl.experiments.runner import ExperimentInterrupted
    from saorl.parent_death import die_with_parent

    trained = [a for a in runner.spec.arms if a != runner.spec.start_arm]
    got = re.fullmatch(r"(.+):(\d+)", which, re.ASCII)
    if got is None or got[1] not in trained:
        print(f"saorl experiment: --run ARM:SEED with a trained arm of {runner.spec.name!r} "
              f"({', '.join(trained)}) and a seed >= 0, got {which!r}", file=sys.stderr)
        return 2
    arm, seed = got[1], got[2]
    parent = os.environ.get(PARENT_ENV, "")
    die_with_parent(int(parent) if parent.isdigit() else os.getppid(), kernel_signal=True)
    try:
        runner.run_one(arm, int(seed))
    except ExperimentInterrupted as e:
        print(f"saorl experiment: {e}", file=sys.stderr)
        return 130
    return 0


def weak_start(spec, path: Path, arm: str, sel, quick_cfg) -> str | None:
    """With ``--quick``: when the quick settings shrink the SFT warm start (the specs' do: 100 steps
    on 200 demonstrations), one paragraph saying the accuracies will be meaningless and which
    overrides give the full warm start — the one ``saorl train`` caches, reused from there."""
    from saorl.experiments.spec import arm_config

    full = arm_config(spec, path, arm, sel.seeds[0], quick=False, extra=list(sel.extra)).sft.model_dump()
    quick = quick_cfg.sft.model_dump()
    if not quick["enabled"]:
        return None
    fix = [f"sft.{k}={full[k]}" for k in ("steps", "batch_size", "num_demos", "lr") if quick[k] != full[k]]
    if not fix:
        return None
    return (f"--quick is a smoke test of the pipeline, not a result: its SFT warm start "
            f"({quick['steps']} steps x {quick['batch_size']} on {quick['num_demos']} demonstrations) is too "
            "weak to solve these tasks, so expect accuracies of about 0.000 and flat curves. For numbers "
            "that mean something, keep --quick and add the full warm start: "
            f"saorl experiment {spec.name} --quick {' '.join(fix)} (it reuses the warm start `saorl train` "
            "cached with the same settings in runs/.cache, else trains it once into the experiment's"
            " .cache).")
