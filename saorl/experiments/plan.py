"""What an experiment will cost, and where its env's reward switches fall (for ``saorl experiment``)."""

from __future__ import annotations


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

    env = make_env_factory(cfg.env.type, cfg.env.env_options)()
    points = getattr(env, "switch_points", None)
    if points is None or getattr(env, "schedule_unit", "trainer_step") != "trainer_step":
        return []
    return [s for s, _ in points(cfg.trainer.steps)]
