"""examples/openenv_textarena: a TextArena game behind openenv-core's own server plays, over saorl's
``openenv`` env, the very episode saorl's ``textarena`` env plays (prompt, observations, rewards)."""

from __future__ import annotations

import random

import pytest

from saorl.envs.openenv_server import stop_all
from saorl.envs.registry import make_env_factory

from .community import need
from .episodes import play

need("openenv")
need("textarena")

MODULE = "examples.openenv_textarena.server:app"
GAME = "GuessTheNumber-v0-hardcore"


@pytest.fixture(scope="module")
def served():
    factory = make_env_factory("openenv", {"module": MODULE, "max_turns": 10, "stop": ["]"],
                                           "start_timeout_s": 120})
    yield factory
    stop_all()


def test_the_served_game_is_the_textarena_envs_game(served):
    from saorl.envs.base import Task

    env = served()
    assert env.stop_strings == ("]",) and env.max_turns == 10
    task = env.generate_tasks("test", 1, seed=0)[0]
    seed = int(task.id.removeprefix("openenv-"))
    game = make_env_factory("textarena", {"game": GAME, "reward": "win"})()
    same = Task(f"{GAME}-{seed}", {"game": GAME, "seed": seed})
    moves = game.demonstration(same, random.Random(0))
    assert env.reset(task) == game.reset(same)
    assert env.action_field == "move"  # read from the server's action schema
    for move in ["no move", *moves]:
        ours, theirs = env.step(move), game.step(move)
        assert (ours.observation, ours.reward, ours.done) == (theirs.observation, theirs.reward, theirs.done)
        if ours.done:
            break
    assert ours.done and ours.reward == 1.0 and ours.info == {"success": True}  # the scripted player won
    lost = play(served(), task, ["[1]"] * 10)  # the same guess again and again loses the game
    theirs = play(game, same, ["[1]"] * 10)
    def seen(results):
        return [(r.observation, r.reward, r.done) for r in results]

    assert seen(lost) == seen(theirs)
    assert sum(r.reward for r in lost) == 0.0 and not lost[-1].info.get("success")
