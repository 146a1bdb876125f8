"""OpenEnv servers for the ``openenv`` env's tests, written to openenv-core's own interface.

``app``: a guess-the-number game (``create_app`` of an ``Environment`` with its Action and
Observation models): the secret (1 to 8) comes from the seed given to ``reset``; each guess is
answered ``higher`` / ``lower`` / ``correct``; a correct guess earns 1.0 and ends the game, and the
fourth wrong one ends it with nothing (servers that misbehave: :mod:`openenv_fakes`).
"""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 4


class GuessAction(Action):
    guess: str = Field(..., description="the guessed number, as text")


class GuessObservation(Observation):
    message: str = Field(default="", description="what the game says")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = random.Random(seed).randint(1, 8)
        return GuessObservation(message=f"Guess my number from 1 to 8 in {MAX_GUESSES} tries. Answer with "
                                        "the number only.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = "".join(c for c in action.guess if c.isdigit())
        guess = int(digits) if digits else None
        if guess == self.secret:
            return GuessObservation(message="correct", done=True, reward=1.0)
        done = self._state.step_count >= MAX_GUESSES
        hint = "not a number" if guess is None else ("higher" if guess < self.secret else "lower")
        return GuessObservation(message=hint, done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8)
