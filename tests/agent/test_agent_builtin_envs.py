"""Demonstrations of the built-in envs through the agent loop: valid, token-exact SFT trajectories."""

from __future__ import annotations

import asyncio
import random

import pytest

from saorl.agent import demonstration_trajectory, render_trajectory

registry = pytest.importorskip("saorl.envs.registry", reason="saorl.envs.registry is not importable")


@pytest.mark.parametrize("name", ["math_tool", "style_shift"])
def test_builtin_demonstrations_become_exact_trajectories(tok, name):
    if name == "math_tool":
        pytest.importorskip("saorl.envs.sandbox", reason="math_tool's sandbox is not importable")
    factory = registry.make_env_factory(name)
    for task in factory().generate_tasks("test", 2, 0):
        env = factory()
        traj = asyncio.run(demonstration_trajectory(env, task, tok, random.Random(1)))
        traj.validate()
        demo = factory().demonstration(task, random.Random(1))
        spans = traj.episode.turn_spans
        assert len(spans) == traj.episode.turns <= len(demo)
        assert tok.decode(traj.token_ids[: traj.prompt_len]) == factory().reset(task)
        for (a, b), action in zip(spans, demo):
            ids = tok.encode(action, add_special_tokens=False)
            ends_turn = any(action.endswith(s) for s in env.stop_strings)
            assert traj.token_ids[a:b] == (ids if ends_turn else [*ids, tok.eos_token_id])
        assert all(lp == 0.0 for lp in traj.rollout_logprobs)
        assert isinstance(traj.episode.success, bool)  # demonstrations may be deliberately wrong
        assert render_trajectory(traj, tok, color=False).count("[act ") == len(spans)
