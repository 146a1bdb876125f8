"""TextArena demonstrations: the scripted players' moves, played through the env on the real games."""

from __future__ import annotations

import random
import re

import pytest

from saorl.envs.demo import play_demonstration
from saorl.envs.registry import make_env_factory

from .community import need

need("textarena")


def _env(game):
    return make_env_factory("textarena", {"game": game})()


@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "GuessTheNumber-v0-hardcore", "FrozenLake-v0",
                                  "FrozenLake-v0-hardcore"])
def test_a_demonstration_wins_each_held_out_game_and_replays_it(game):
    tasks = _env(game).generate_tasks("test", 12, seed=3)
    for task in tasks:
        ep = play_demonstration(_env(game), task, random.Random(task.id))
        assert ep.done and ep.success and ep.reward == 1.0, (task.id, ep.turns, ep.info)
        assert ep.info["metrics"]["invalid_move"] == 0.0
        # the same moves played again give the same game, observation for observation
        again = play_demonstration(_env(game), task, random.Random(task.id))
        assert again.turns == ep.turns


def test_guess_the_number_guesses_only_what_the_hints_leave_possible():
    env = _env("GuessTheNumber-v0-hardcore")
    seen_lengths = set()
    for task in env.generate_tasks("train", 40, seed=0):
        ep = play_demonstration(_env("GuessTheNumber-v0-hardcore"), task, random.Random(0))
        low, high, guesses = 1, 50, []
        for action, observation in ep.turns:
            assert re.fullmatch(r"\[\d+\]", action)
            guess = int(action[1:-1])
            assert low <= guess <= high and guess not in guesses
            guesses.append(guess)
            if "higher" in observation:
                low = guess + 1
            elif "lower" in observation:
                high = guess - 1
        seen_lengths.add(len(ep.turns))
    assert len(seen_lengths) > 3  # random among the possible, not one fixed search


def test_frozen_lake_takes_a_shortest_safe_path():
    game = "FrozenLake-v0"
    for task in _env(game).generate_tasks("train", 10, seed=1):
        env = _env(game)
        env.reset(task)
        grid = env._game.state.game_state["grid"]
        # breadth-first distance from the start over safe ice, computed here
        dist, frontier = {(0, 0): 0}, [(0, 0)]
        while frontier:
            nxt = []
            for r, c in frontier:
                for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                    p = (r + dr, c + dc)
                    if 0 <= p[0] < 4 and 0 <= p[1] < 4 and p not in dist and grid[p[0]][p[1]] != "H":
                        dist[p] = dist[(r, c)] + 1
                        nxt.append(p)
            frontier = nxt
        ep = play_demonstration(_env(game), task, random.Random(7))
        assert ep.success and len(ep.turns) == dist[(3, 3)]


def test_tower_of_hanoi_plays_the_optimal_solution():
    env = _env("TowerOfHanoi-v0")
    task = env.generate_tasks("train", 1, seed=0)[0]
    assert env.demonstration(task, random.Random(0)) == ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]",
                                                         "[B C]", "[A C]"]
    medium = _env("TowerOfHanoi-v0-medium")
    ep = play_demonstration(medium, medium.generate_tasks("train", 1, seed=0)[0], random.Random(0))
    assert ep.success and len(ep.turns) == 15


def test_a_game_without_a_scripted_player_says_which_games_have_one():
    env = _env("Blackjack-v0")
    task = env.generate_tasks("train", 1, seed=0)[0]
    with pytest.raises(NotImplementedError, match=r"'Blackjack-v0' has no scripted player.*GuessTheNumber"):
        env.demonstration(task, random.Random(0))


def test_an_sft_run_on_a_game_without_a_player_stops_at_start_up_naming_the_games_with_one():
    from saorl.config.loading import load_config
    from saorl.stages.preflight import StartupError, check_demonstrations

    cfg = load_config(None, ["env.type=textarena", "env.options.game=Blackjack-v0", "sft.enabled=true"])
    with pytest.raises(StartupError) as e:
        check_demonstrations(cfg, make_env_factory("textarena", {"game": "Blackjack-v0"}))
    assert "has no demonstrations (textarena game 'Blackjack-v0' has no scripted player" in str(e.value)
    assert "FrozenLake, GuessTheNumber, TowerOfHanoi" in str(e.value) and "sft.enabled=false" in str(e.value)
    ok = load_config(None, ["env.type=textarena", "env.options.game=GuessTheNumber-v0", "sft.enabled=true"])
    check_demonstrations(ok, make_env_factory("textarena", {"game": "GuessTheNumber-v0"}))


def test_the_textarena_recipe_loads_and_its_demonstrations_fit_its_budgets():
    """configs/recipes/smollm2_135m_textarena.yaml: the game and the SFT warm start it measured; each
    scripted move fits ``rollout.max_new_tokens`` (counted by the shipped tokenizer: SmolLM2's need
    not be on this machine) and ends at the stop string, as the model's moves are cut."""
    from pathlib import Path

    from saorl.config.loading import load_config
    from saorl.models.tokenizer import load_tokenizer

    recipe = Path(__file__).resolve().parents[2] / "configs" / "recipes" / "smollm2_135m_textarena.yaml"
    cfg = load_config(recipe)
    game = "GuessTheNumber-v0-hardcore"
    assert (cfg.env.type, cfg.env.options["game"], cfg.sft.enabled) == ("textarena", game, True)
    env = make_env_factory(cfg.env.type, cfg.env.options)()
    tokenizer = load_tokenizer(None)
    for task in env.generate_tasks("train", 8, seed=cfg.seed):
        for move in env.demonstration(task, random.Random(0)):
            assert move.endswith(tuple(env.stop_strings))
            assert len(tokenizer(move, add_special_tokens=False)["input_ids"]) <= cfg.rollout.max_new_tokens
