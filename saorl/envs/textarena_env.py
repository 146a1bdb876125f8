"""``textarena``: a single-player TextArena game, played turn by turn as the package defines it.

``env.options.game`` is a TextArena id (``TowerOfHanoi-v0``, ``FrozenLake-v0``, ``Mastermind-v0``,
``Minesweeper-v0-small``, ``GuessTheNumber-v0``, …; the ``envs`` extra installs TextArena). The game
is made from the id's registration (its class and keyword arguments: board size, turn limit) and
reset for one player with the task's seed; its rules, messages, rewards and end are the game's:

- the prompt is the game's first observation (its rules and the board), each message rendered as
  TextArena's ``LLMObservationWrapper`` renders it, ``[GAME] message``;
- each action (the text the model wrote this turn) goes through the id's own action wrappers
  (``ActionFormattingWrapper``: brackets added when the text has none) to the game's ``step``;
- the observation after it is the messages the game added since, rendered the same way, on lines
  of their own (the
  model's own action, already in the context, is left out: TextArena's observation wrappers
  repeat the whole history each turn, which the trajectory already holds);
- an invalid move is what the game makes of it: a warning and another try, or the end, per the
  game's own error allowance; the episode ends when the game says ``done``; its reward is the
  game's reward for the player (``env.close()``), given on the last turn (``info["success"]``:
  reward ≥ ``success_threshold``, 1.0; ``info["metrics"]``: the game's ``invalid_move`` and
  ``turn_count``, and ``rewarded_wrong``, 1 for a lost game the game still rewarded: its shaping,
  e.g. GuessTheNumber's closeness of the last guess). ``reward: win`` gives 1 for a success and 0
  otherwise instead, for games whose shaping can be gamed. At ``max_turns`` model turns (default:
  what the game's own turn limit allows, a retry after each refused move included: the limit
  plus one, times one plus the game's error allowance, else 30) without an end the episode stops
  unsuccessful, with no reward.
- demonstrations (for the SFT warm start): the moves of a scripted player, for the games that
  have one (GuessTheNumber, FrozenLake, TowerOfHanoi: :mod:`saorl.envs.textarena_players`).

**Determinism.** A task is a seed (``Game-v0-<seed>``); a seed's split is decided by the content
of its start (the first observation hashes into one split, :mod:`saorl.envs.splits`), so no test
game starts as a train game does; a game whose start is the same for every seed has no test split
(asking for test tasks is an error naming the game) unless it draws random numbers later in play
(Minesweeper's mines), which splits it by seed. TextArena games draw from Python's global
``random`` (and Sokoban from numpy's): each episode keeps its own generator state, swapped in
under a lock around every call into the game, so concurrent episodes neither share nor disturb a
random stream and a task replays the same game.

Only single-player games: a game that does not start for one player is refused. Some games need
network resources TextArena downloads at import (NLTK word lists: Wordle, Hangman, …) or an API
key (an LLM jury); docs/envs.md lists the ones that run offline.
"""

from __future__ import annotations

import functools
import importlib
import random
import re
import threading
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.splits import content_hash, distinct_tasks

TEST_FRACTION = 0.5
DEFAULT_MAX_TURNS = 30
_RANDOM_LOCK = threading.Lock()
"""Serialises calls into games: they draw from the process-global random generators."""


def _registry() -> dict[str, Any]:
    """TextArena's registry of games, filled. The package's import fills it game by game after the
    registry's module is imported, so reading that module alone while another thread imports the
    package sees it half filled (games "not a TextArena id" when envs are made in threads, as an
    OpenEnv server does); importing the package first waits for that import to finish."""
    import textarena  # noqa: F401
    from textarena.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


def game_ids() -> list[str]:
    """Every id TextArena registers (single- and multi-player), sorted."""
    return sorted(_registry())


class _Randomness:
    """An episode's own state of the global ``random`` (and numpy's) generators, swapped in around
    each call into the game."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.py = random.Random(seed).getstate()
        self.np = np.random.RandomState(seed).get_state()

    def run(self, fn, *args: Any, **kwargs: Any) -> Any:
        import numpy as np

        with _RANDOM_LOCK:
            saved_py, saved_np = random.getstate(), np.random.get_state()
            random.setstate(self.py)
            np.random.set_state(self.np)
            try:
                return fn(*args, **kwargs)
            finally:
                self.py, self.np = random.getstate(), np.random.get_state()
                random.setstate(saved_py)
                np.random.set_state(saved_np)


def _render(messages: list[tuple[Any, str, Any]], role_mapping: dict[int, str]) -> str:
    """Messages as TextArena's LLMObservationWrapper renders them, the player's own actions left out."""
    from textarena.core import GAME_ID, ObservationType

    lines = []
    for sender, message, kind in messages:
        if kind == ObservationType.PLAYER_ACTION:
            continue
        name = "GAME" if sender == GAME_ID else role_mapping.get(sender, f"Player {sender}")
        lines.append(f"[{name}] {message}")
    return "\n".join(lines)


@functools.cache
def _probe(game: str) -> int | None:
    """The model turns the game's own limit allows, once it is made and started for one player
    (once per process: an env is made per episode): its turn limit plus one (checked before the
    move is counted) times one plus its error allowance (each turn may be a refused move and its
    retry: the game counts the valid ones), so the game ends its own games; None when it has no
    limit; ValueError saying why a game cannot be played here."""
    try:
        probe = _make(game)[0]
    except LookupError as e:  # NLTK data the game's module tried to download at import
        found = re.search(r"Resource '?([\w/.-]+)'? not found", str(e))
        what = f"NLTK's {found.group(1)!r}" if found else "NLTK data"
        raise ValueError(f"game {game!r} cannot be made here: it needs {what}, which TextArena downloads "
                         "when the game is imported, so it does not run offline; docs/envs.md lists the "
                         "games that do") from None
    except Exception as e:
        raise ValueError(f"game {game!r} cannot be made here: {type(e).__name__}: {str(e)[:300]}") from None
    try:
        _Randomness(0).run(probe.reset, num_players=1, seed=0)
    except Exception as e:
        raise ValueError(f"game {game!r} does not start for one player ({type(e).__name__}: {e}); "
                         "saorl plays single-player TextArena games only") from None
    from textarena.state import SinglePlayerState

    if not isinstance(probe.state, SinglePlayerState):
        raise ValueError(f"game {game!r} is a {type(probe.state).__name__} game; saorl plays "
                         "single-player TextArena games only")
    limit = getattr(probe, "max_turns", None)
    if not isinstance(limit, int) or limit < 1:
        return None
    # the games check the limit before they count the move (GuessTheNumber's 10 plays 11 guesses),
    # and a move refused with a warning and another try is not counted at all
    retries = getattr(probe.state, "error_allowance", 0)
    return (limit + 1) * (1 + (retries if isinstance(retries, int) and retries > 0 else 0))

@functools.cache
def _draws_randomness(game: str) -> bool:
    """Whether the game's module draws from ``random`` or numpy's generators (not just imports them)."""
    import inspect
    import sys

    source = inspect.getsource(sys.modules[type(_make(game)[0]).__module__])
    return re.search(r"\brandom\.\w+\s*\(|from random import|np\.random|numpy\.random", source) is not None


def _make(game: str) -> tuple[Any, list[Any]]:
    """The game of ``game`` as its registration makes it, without wrappers, and the id's action
    wrappers."""
    from textarena.core import ActionWrapper

    spec = _registry()[game]
    entry = spec.entry_point
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    actions = [w for w in (spec.default_wrappers or []) if issubclass(w, ActionWrapper)]
    return entry(**spec.kwargs), actions


def _play(game: Any, wrappers: list[Any], randomness: _Randomness, action: str) -> bool:
    """Step ``game`` with ``action`` through the id's action wrappers; whether the game is done."""
    for wrapper in wrappers:
        action = wrapper(game).action(action)
    done, _ = randomness.run(game.step, action)
    return done


class TextArenaEnv(Env):
    name: ClassVar[str] = "textarena"
    version: ClassVar[int] = 2  # 2: demonstrations
    requires: ClassVar[tuple[str, ...]] = ("textarena",)
    reward_only_options: ClassVar[tuple[str, ...]] = ("reward",)

    def __init__(self, game: str | None = None, max_turns: int | None = None, success_threshold: float = 1.0,
                 stop: list[str] | None = None, reward: str = "game", **options: Any) -> None:
        """Options: ``game`` (required: a single-player TextArena id), ``max_turns`` (model turns
        before the episode stops; default what the game's turn limit allows, its retries of
        refused moves included, else 30), ``success_threshold``
        (1.0: success is the game's reward ≥ it), ``stop`` (strings that end a turn, e.g. ``["]"]``;
        default none: eos or ``rollout.max_new_tokens``), ``reward`` (``game``: the game's own
        reward, its shaping of a lost game included; ``win``: 1 for a success, else 0)."""
        super().__init__(**options)
        if reward not in ("game", "win"):
            raise ValueError(f"reward must be 'game' (the game's own reward) or 'win' (1 for a success, "
                             f"else 0), got {reward!r}")
        self.reward_kind = reward
        import difflib

        ids = game_ids()
        if not isinstance(game, str) or game not in ids:
            close = difflib.get_close_matches(str(game), ids, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ValueError(f"game {game!r} is not a TextArena id; {hint}set env.options.game to a "
                             "single-player id such as TowerOfHanoi-v0, FrozenLake-v0, Mastermind-v0 "
                             "(docs/envs.md lists the ones that run offline)")
        if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.game, self.success_threshold = game, float(success_threshold)
        self.stop_strings = tuple(stop or ())  # type: ignore[misc]  # per instance: an option here
        game_limit = _probe(game)
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be a positive integer, got {max_turns!r}")
        self.max_turns = max_turns or game_limit or DEFAULT_MAX_TURNS
        self._game: Any = None
        self._rng: _Randomness | None = None
        self._actions: list[Any] = []

    def start(self, seed: int) -> str:
        """The content of the game's start for ``seed``: its first observation and its state."""
        game, rng = _make(self.game)[0], _Randomness(seed)
        rng.run(game.reset, num_players=1, seed=seed)
        _, messages = game.get_observation()
        state = sorted(game.state.game_state.items(), key=lambda kv: str(kv[0]))
        state_text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(state))  # objects' addresses differ per run
        return f"{_render(messages, game.state.role_mapping)}\x1f{state_text}"

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """Seeds split by the content of their start, so no test game starts as a train game does
        (a game with few starts has few of each). A game that starts the same for 16 seeds is split
        by seed if its code draws random numbers later (Minesweeper places its mines at the first
        move), else it has train tasks only."""
        by_seed = len({self.start(s) for s in range(16)}) == 1
        if by_seed and not _draws_randomness(self.game):
            if split == "test":
                raise ValueError(f"textarena game {self.game!r} starts the same whatever the seed and "
                                 "draws no random numbers, so every test task would be a train task: it "
                                 "has no test split; play a game whose start the seed changes, or give "
                                 "test tasks from elsewhere (env.test_tasks_file)")
            split, test_fraction = "train", 1e-9
        else:
            test_fraction = TEST_FRACTION

        def draw(rng: random.Random):
            game_seed = rng.randrange(2**31)
            content = game_seed if by_seed else self.start(game_seed)
            return content_hash("textarena", self.game, content), self._task(game_seed)

        return distinct_tasks(split, n, random.Random(seed), draw, test_fraction,
                              f"{self.game} seeds (split by their start: a game with few starts has few "
                              "of each split)")

    def _task(self, game_seed: int):
        return lambda d: Task(f"{self.game}-{game_seed}", {"game": self.game, "seed": game_seed})

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        if task.data.get("game") != self.game or not isinstance(task.data.get("seed"), int):
            raise ValueError(f"task {task.id!r} is not a {self.game} task (it needs game {self.game!r} and "
                             f"an integer seed; got {task.data})")
        (self._game, self._actions), self._rng = _make(self.game), _Randomness(task.data["seed"])
        self._rng.run(self._game.reset, num_players=1, seed=task.data["seed"])
        return self._observe()

    def _observe(self) -> str:
        _, messages = self._game.get_observation()
        return _render(messages, self._game.state.role_mapping)

    def step(self, action: str) -> StepResult:
        if self._game is None or self._rng is None:
            raise RuntimeError("TextArenaEnv.step called before reset (or after the episode ended)")
        done = _play(self._game, self._actions, self._rng, action)
        new = self._observe()
        observation = f"\n{new}\n" if new else ""  # on its own lines after the action
        if not done:
            return StepResult(observation, 0.0, False)
        rewards, game_info = self._game.close()
        info = (game_info or {}).get(0, {})
        raw = (rewards or {}).get(0, 0.0)
        try:
            reward = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"game {self.game!r} ended the episode with a reward that is not a number "
                             f"({raw!r}; reason {info.get('reason')!r}): a bug in the game's code, not "
                             "in the model's move; pick another game (docs/envs.md lists the ids known "
                             "to play)") from None
        self._game = None
        success = reward >= self.success_threshold
        metrics = {"invalid_move": float(bool(info.get("invalid_move"))),
                   "turn_count": float(info.get("turn_count", 0)),
                   "rewarded_wrong": float(reward > 0 and not success)}
        if self.reward_kind == "win":
            reward = float(success)
        return StepResult(observation, reward, True, {"success": success,
                                                      "reason": str(info.get("reason", "")),
                                                      "metrics": metrics})

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The moves of the game's scripted player (:mod:`saorl.envs.textarena_players`), played on a
        game of its own made as :meth:`reset` makes it, so the env replays the same game."""
        from saorl.envs.textarena_players import PLAYERS

        game, wrappers = _make(self.game)
        player = PLAYERS.get(type(game).__name__)
        if player is None:
            games = ", ".join(sorted(name.removesuffix("Env") for name in PLAYERS))
            raise NotImplementedError(f"textarena game {self.game!r} has no scripted player; the games "
                                      f"with one (any of their ids): {games}")
        randomness = _Randomness(task.data["seed"])
        randomness.run(game.reset, num_players=1, seed=task.data["seed"])
        actions: list[str] = []
        for _ in range(self.max_turns):
            actions.append(player(game, rng))
            if _play(game, wrappers, randomness, actions[-1]):
                break
        return actions
