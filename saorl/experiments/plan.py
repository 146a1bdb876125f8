"""What an experiment will cost, and where its env's reward switches fall (for ``saorl experiment``)."""

from __future__ import annotations


def _hms(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def cost_lines(spec, arms: list[str], seeds: list[int], quick: bool,
               budget: tuple[int, float | None] | None = None) -> list[str]:
    """What the full version may take (arms × seeds × max_wall_s), then this invocation if it differs.

    ``budget``: this invocation's (trainer steps, max_wall_s) as resolved for its arms, the command
    line's ``trainer.steps=…`` / ``trainer.max_wall_s=…`` included; None takes the spec's (the quick
    budget with ``quick``)."""
    from saorl.experiments.spec import selected_arms, selected_seeds

    def spec_budget(is_quick: bool) -> tuple[int, float | None]:
        b = spec.quick.budget if is_quick and spec.quick.budget else spec.budget
        return b.steps, b.max_wall_s

    full = (selected_arms(spec, False, None), selected_seeds(spec, False, None))
    this = budget or spec_budget(quick)
    todo = [("full version", full[0], full[1], spec_budget(False))]
    if (arms, seeds, this) != (*full, spec_budget(False)):
        todo.append(("this run", arms, seeds, this))
    lines = []
    for label, a, s, (steps, wall_s) in todo:
        n = len([x for x in a if x != spec.start_arm])
        if wall_s is None:
            lines.append(f"{label}: {n} trained arms x {len(s)} seeds x {steps} steps "
                         "(no wall-clock limit in the spec, so no time bound)")
            continue
        lines.append(f"{label}: may take up to {n} arms x {len(s)} seeds x {wall_s:.0f} s = "
                     f"{_hms(n * len(s) * wall_s)} of RL ({steps} steps or "
                     f"{wall_s:.0f} s per run, whichever comes first), plus the SFT warm start, "
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
