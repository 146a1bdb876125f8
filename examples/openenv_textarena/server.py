"""An OpenEnv environment server that plays a single-player TextArena game (docs/envs.md, `openenv`).

What a user brings to ``env.type: openenv``: an app made by openenv-core's ``create_app`` from an
``Environment`` with its ``Action`` and ``Observation`` models. Here the environment is a TextArena
game, played by saorl's own ``textarena`` env inside the server (its rules, seeded randomness and
rendering), so the prompt and every observation are the text the ``textarena`` env gives: a model
warm-started on that env plays the same game through the WebSocket. The game comes from the
environment variable ``TEXTARENA_GAME`` (default ``GuessTheNumber-v0-hardcore``); the reward is 1
for a won game, else 0.

    # saorl starts it on loopback for the run (from the repository's root):
    saorl train configs/recipes/smollm2_135m_openenv.yaml
    # or serve it yourself and give env.options.url=http://127.0.0.1:8000:
    python -m uvicorn examples.openenv_textarena.server:app --port 8000
"""

from __future__ import annotations

import os
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from saorl.envs.base import Task
from saorl.envs.textarena_env import TextArenaEnv

GAME = os.environ.get("TEXTARENA_GAME", "GuessTheNumber-v0-hardcore")


class MoveAction(Action):
    move: str = Field(..., description="the player's move, as the model wrote it")


class GameObservation(Observation):
    text: str = Field(default="", description="what the game says")


class TextArenaGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one game per WebSocket session

    def __init__(self) -> None:
        super().__init__()
        self._game = TextArenaEnv(game=GAME, reward="win")
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GameObservation:
        seed = 0 if seed is None else int(seed)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        prompt = self._game.reset(Task(f"{GAME}-{seed}", {"game": GAME, "seed": seed}))
        return GameObservation(text=prompt, done=False, reward=0.0)

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> GameObservation:
        self._state.step_count += 1
        out = self._game.step(action.move)
        return GameObservation(text=out.observation.strip("\n"), done=out.done, reward=out.reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(TextArenaGame, MoveAction, GameObservation, env_name="textarena", max_concurrent_envs=32)
