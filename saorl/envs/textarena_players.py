"""Scripted players of TextArena games: the demonstrations an SFT warm start learns a game's moves from.

A player is a function ``move(game, rng) -> str`` of the game as it stands (the TextArena game
object, read only) that returns the text of the next move, in the game's own format. They play
well but not perfectly, as demonstrations here do (a model warm-started on them still has
something to learn from RL):

- ``GuessTheNumber``: a number drawn uniformly from those the hints so far leave possible (not the
  midpoint of binary search): it never repeats a guess or leaves the range, and wins in 5 guesses
  or so of 1-20;
- ``FrozenLake``: the first move of a shortest path to the goal over safe ice, ties broken at
  random;
- ``TowerOfHanoi``: the optimal solution's next move (the game starts the same every time).

:data:`PLAYERS` maps a game's class name to its player; a game without one has no demonstrations.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any


def guess_the_number(game: Any, rng: random.Random) -> str:
    low, high = game.min_number, game.max_number
    for guess, hint in game.state.game_state["guess_history"]:
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    return f"[{rng.randint(low, high)}]" if low <= high else f"[{low}]"


_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def frozen_lake(game: Any, rng: random.Random) -> str:
    grid, start = game.state.game_state["grid"], tuple(game.state.game_state["player_pos"])
    goal, size = tuple(game.state.game_state["goal_pos"]), len(grid)
    first: dict[tuple[int, int], str | None] = {start: None}
    queue = deque([start])
    while queue:
        pos = queue.popleft()
        if pos == goal:
            return f"[{first[pos]}]"
        names = list(_MOVES)
        rng.shuffle(names)
        for name in names:
            dr, dc = _MOVES[name]
            nxt = (pos[0] + dr, pos[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in first and grid[nxt[0]][nxt[1]] != "H":
                first[nxt] = first[pos] or name
                queue.append(nxt)
    return f"[{rng.choice(list(_MOVES))}]"  # no safe path (the game makes sure there is one)


def _hanoi(n: int, source: str, target: str, spare: str) -> list[tuple[str, str]]:
    if n == 0:
        return []
    return [*_hanoi(n - 1, source, spare, target), (source, target), *_hanoi(n - 1, spare, target, source)]


def tower_of_hanoi(game: Any, rng: random.Random) -> str:
    towers = game.state.game_state["towers"]
    n = sum(len(t) for t in towers.values())
    state = {"A": list(range(n, 0, -1)), "B": [], "C": []}
    for source, target in _hanoi(n, "A", "C", "B"):  # the first move of the solution not yet made
        if state == towers:
            return f"[{source} {target}]"
        state[target].append(state[source].pop())
    return "[A C]"  # off the optimal path: the game rules on it


PLAYERS: dict[str, Callable[[Any, random.Random], str]] = {
    "GuessTheNumberEnv": guess_the_number,
    "FrozenLakeEnv": frozen_lake,
    "TowerOfHanoiEnv": tower_of_hanoi,
}
