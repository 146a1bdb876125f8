"""``saorl experiment NAME|PATH [--quick] [--out DIR] [--seeds N] [--arms a,b] [key=value ...]``.

Runs every arm × seed of an experiment spec (``configs/experiments/NAME.yaml``) one after another,
then writes ``OUT/report.md`` (the comparison table and plots) and ``OUT/plots/*.png``. Runs that
finished earlier in ``OUT`` are skipped, so an interrupted experiment resumes where it stopped;
``--report`` only redraws the report from what is there. ``key=value`` overrides apply to every arm
(last). Before anything runs it prints what the full version may cost: arms × seeds × the
wall-clock budget per run (plus the SFT warm start and value pretraining, both cached).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saorl.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", metavar="NAME_OR_PATH",
                   help="an experiment name (math, code, ablation, online, stability) or a spec YAML")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides for every arm, applied last (right after the name)")
    p.add_argument("--quick", action="store_true",
                   help="tiny settings from the spec's quick section (minutes on a laptop CPU)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/experiments/NAME[-quick])")
    p.add_argument("--seeds", type=int, metavar="N", help="run the first N seeds (default: the spec's)")
    p.add_argument("--arms", metavar="A,B", help="comma-separated arms to run (default: all)")
    p.add_argument("--report", action="store_true", help="only write the report from existing runs")


def _hms(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def cost_lines(spec, arms: list[str], seeds: list[int], quick: bool) -> list[str]:
    """What the full version may take (arms × seeds × max_wall_s), then this invocation if it differs."""
    from saorl.experiments.spec import selected_arms, selected_seeds

    full = (selected_arms(spec, False, None), selected_seeds(spec, False, None))
    todo = [("full version", False, *full)]
    if quick or (arms, seeds) != full:
        todo.append(("this run", quick, arms, seeds))
    lines = []
    for label, is_quick, a, s in todo:
        budget = spec.quick.budget if is_quick and spec.quick.budget else spec.budget
        n = len([x for x in a if x != spec.start_arm])
        if budget.max_wall_s is None:
            lines.append(f"{label}: {n} trained arms x {len(s)} seeds x {budget.steps} steps "
                         "(no wall-clock limit in the spec, so no time bound)")
            continue
        lines.append(f"{label}: may take up to {n} arms x {len(s)} seeds x {budget.max_wall_s:.0f} s = "
                     f"{_hms(n * len(s) * budget.max_wall_s)} of RL ({budget.steps} steps or "
                     f"{budget.max_wall_s:.0f} s per run, whichever comes first), plus the SFT warm start, "
                     "value pretraining (both cached) and evaluations")
    return lines


def switch_steps(cfg) -> list[int]:
    """The env's switch points in trainer steps (style_shift), or [] for envs without a schedule."""
    from saorl.envs.registry import make_env_factory

    env = make_env_factory(cfg.env.type, cfg.env.options)()
    points = getattr(env, "switch_points", None)
    if points is None or getattr(env, "schedule_unit", "trainer_step") != "trainer_step":
        return []
    return [s for s, _ in points(cfg.trainer.steps)]


def run(args: argparse.Namespace) -> int:
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
        runner = ExperimentRunner(spec, path, out, sel)
        first_arm = next(a for a in sel.arms if a != spec.start_arm) if spec.arms else None
        cfg = runner.config(first_arm or next(iter(spec.arms)), sel.seeds[0])
    except (SpecError, ConfigError) as e:
        print(f"saorl experiment: {e}", file=sys.stderr)
        return 2
    print(f"experiment {spec.name}: arms {', '.join(sel.arms)}; seeds {sel.seeds} -> {out}")
    for line in cost_lines(spec, sel.arms, sel.seeds, args.quick):
        print(line)
    status = 0
    if not args.report:
        try:
            runner.run()
        except ExperimentInterrupted as e:
            print(f"saorl experiment: {e}", file=sys.stderr)
            status = 130
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
    note = (f"Mode: {mode}; {cfg.env.type}; budget {cfg.trainer.steps} steps / "
            f"{cfg.trainer.max_wall_s or 'unlimited'} s per run; batch {cfg.trainer.batch_size}; "
            f"policy lr {cfg.trainer.policy_lr:g}; seeds {sel.seeds}.")
    if left_out:
        note += f" Not finished, left out of the table and plots: {', '.join(left_out)}."
    report = write_report(out, spec.name, spec.description, arms, spec.plots, start_arm=spec.start_arm,
                          switches=switch_steps(cfg) if "switches" in spec.plots else (), note=note)
    print(report.read_text(encoding="utf-8").split("\n\n![", 1)[0])
    print(f"\nreport: {report}")
    return status
