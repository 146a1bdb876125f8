"""``textarena`` against the real TextArena package: its games' rules, observations, rewards and ends."""

from __future__ import annotations

import random
import threading

import pytest

from saorl.envs.registry import make_env_factory

from .community import need
from .episodes import play

need("textarena")

HANOI = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]


def _factory(game, **options):
    return make_env_factory("textarena", {"game": game, **options})


def test_tower_of_hanoi_solved_over_seven_turns_earns_the_games_reward():
    factory = _factory("TowerOfHanoi-v0")
    env = factory()
    task = env.generate_tasks("train", 1, seed=0)[0]
    prompt = env.reset(task)
    assert prompt.startswith("[GAME] You are playing Tower of Hanoi with 3 disks.")
    assert "A: [3, 2, 1]" in prompt
    results = play(factory(), task, HANOI)
    assert [r.done for r in results] == [False] * 6 + [True]
    assert results[0].observation == ("\n[GAME] You moved disk 1 from A to C.\n[GAME] Current Board: \n"
                                      "A: [3, 2]\nB: []\nC: [1]\n.\n")
    assert [r.reward for r in results] == [0.0] * 6 + [1.0]
    assert results[-1].info["success"]
    assert results[-1].info["metrics"] == {"invalid_move": 0.0, "turn_count": 7.0, "rewarded_wrong": 0.0}
    # the game's turn limit (14) is checked before a move counts, and a refused move (one retry
    # allowed) does not count: (14 + 1) x 2 model turns, so the game ends its own games
    assert env.max_turns == 30


def test_an_invalid_move_is_what_the_game_makes_of_it():
    env = _factory("TowerOfHanoi-v0")()
    task = env.generate_tasks("train", 1, seed=0)[0]
    first, second = play(env, task, ["[C A]", "[C A]"])
    assert not first.done and "You attempted an invalid move" in first.observation
    assert second.done and second.reward == 0.0 and not second.info["success"]
    assert second.info["metrics"]["invalid_move"] == 1.0 and second.info["reason"].startswith("Invalid Move")


def test_refused_moves_and_their_retries_fit_in_the_default_turn_budget():
    # GuessTheNumber-v0: a limit of 10 turns, checked before a guess counts (11 guesses); a refused
    # move gets a warning and a retry the game does not count: 11 guesses each after a refused move
    # are 22 model turns, and the game, not the turn budget, ends the episode
    env = _factory("GuessTheNumber-v0")()
    assert env.max_turns == 22
    task = env.generate_tasks("train", 1, seed=0)[0]
    env.reset(task)
    target = env._game.state.game_state["game_number"]
    wrong = [n for n in range(1, 21) if n != target][:11]
    results = play(_factory("GuessTheNumber-v0")(), task, [m for n in wrong for m in ("hello", f"[{n}]")])
    assert len(results) == 22 and [r.done for r in results] == [False] * 21 + [True]
    assert "resubmit a valid move" in results[0].observation
    assert results[-1].info["metrics"]["turn_count"] == 11.0 and not results[-1].info["success"]
    assert "turn limit" in results[-1].info["reason"]
    assert _factory("GuessTheNumber-v0", max_turns=10)().max_turns == 10  # a budget of the config's own


def test_a_game_whose_reward_is_not_a_number_is_named_as_the_games_bug():
    # textarena 0.7.4's ThreeCardMonte-v0 calls set_invalid_move(0.0, message): the message becomes
    # the reward of a malformed move's ending; the error names the game and the value, not float()
    env = _factory("ThreeCardMonte-v0")()
    task = env.generate_tasks("train", 1, seed=0)[0]
    with pytest.raises(ValueError, match=r"game 'ThreeCardMonte-v0' ended the episode with a reward that is "
                                         r"not a number \('Bad action"):
        play(env, task, ["hello", "hello", "hello"])


def _minesweeper(factory, task):
    return [r.observation for r in play(factory(), task, ["[2 2]", "[0 0]", "[4 4]"])]


def test_each_task_is_one_game_whatever_runs_beside_it():
    factory = _factory("Minesweeper-v0-small")
    train = factory().generate_tasks("train", 24, seed=0)
    test = factory().generate_tasks("test", 24, seed=0)
    assert not {t.data["seed"] for t in train} & {t.data["seed"] for t in test}
    assert factory().generate_tasks("train", 24, seed=0) == train
    alone = [_minesweeper(factory, t) for t in train[:4]]
    assert len({tuple(a) for a in alone}) > 1  # the seed makes the board
    before = random.getstate()
    together: dict[int, list[str]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, _minesweeper(factory, train[i])))
               for i in range(4) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(4)] == alone
    assert random.getstate() == before  # the process's own random stream is left alone


def test_multi_player_and_unknown_games_are_refused():
    with pytest.raises(ValueError, match=r"game 'TicTacToe-v0' does not start for one player \(Assertion"
                                         r"Error: The number of players has to be 2.*single-player"):
        _factory("TicTacToe-v0")
    with pytest.raises(ValueError, match=r"did you mean 'TowerOfHanoi-v0"):
        _factory("TowerOfHanoi")


def test_a_game_that_needs_downloaded_word_lists_is_refused_offline():
    try:
        from nltk.corpus import words

        words.words()
        pytest.skip("NLTK's word list is installed here: Wordle runs")
    except LookupError:
        pass
    with pytest.raises(ValueError, match=r"game 'Wordle-v0' cannot be made here: it needs NLTK's 'words', "
                                         r"which TextArena downloads .* does not run offline; docs/envs.md"):
        _factory("Wordle-v0")


def test_no_test_game_starts_as_a_train_game_does():
    hanoi = _factory("TowerOfHanoi-v0")()
    assert len(hanoi.generate_tasks("train", 8, seed=0)) == 8  # one start: train only
    with pytest.raises(ValueError, match=r"textarena game 'TowerOfHanoi-v0' starts the same whatever the "
                                         r"seed .* it has no test split"):
        hanoi.generate_tasks("test", 4, seed=0)
    guess = _factory("GuessTheNumber-v0")()  # few starts (the secret): split by them
    train, test = guess.generate_tasks("train", 40, seed=0), guess.generate_tasks("test", 10, seed=0)
    assert not {guess.start(t.data["seed"]) for t in train} & {guess.start(t.data["seed"]) for t in test}


def test_a_lost_game_the_game_still_rewards_is_counted_and_reward_win_gives_it_nothing():
    # GuessTheNumber scores a lost game by how close the last guess was: two repeats of one guess
    # end a hardcore game (its error allowance) with that shaping reward, a game never won
    def lose(**options):
        env = _factory("GuessTheNumber-v0-hardcore", **options)()
        task = env.generate_tasks("train", 1, seed=3)[0]
        secret = _secret(env, task)
        guess = 25 if secret != 25 else 24
        return play(env, task, [f"[{guess}]"] * 3)[-1], secret, guess

    game, secret, guess = lose()
    assert game.done and not game.info["success"]
    assert game.reward == pytest.approx(1 - abs(guess - secret) / 49, abs=0.02) and game.reward > 0
    assert game.info["metrics"]["rewarded_wrong"] == 1.0 and game.info["metrics"]["invalid_move"] == 1.0
    win, _, _ = lose(reward="win")
    assert win.reward == 0.0 and win.info["metrics"]["rewarded_wrong"] == 1.0

    env = _factory("GuessTheNumber-v0-hardcore", reward="win")()
    task = env.generate_tasks("train", 1, seed=3)[0]
    won = play(env, task, [f"[{_secret(env, task)}]"])[-1]
    assert won.done and won.reward == 1.0 and won.info["success"]
    assert won.info["metrics"]["rewarded_wrong"] == 0.0
    with pytest.raises(ValueError, match=r"reward must be 'game' .* or 'win' .*, got 'wins'"):
        _factory("GuessTheNumber-v0-hardcore", reward="wins")()


def test_the_sft_warm_start_is_keyed_without_the_reward_option():
    from saorl.config import load_config
    from saorl.stages.sft import sft_key

    def key(*extra):
        return sft_key(load_config(None, ["env.type=textarena", "env.options.game=GuessTheNumber-v0",
                                          *extra]))

    assert key("env.options.reward=win") == key() == key("env.options.reward=game")
    assert key("env.options.game=GuessTheNumber-v0-hardcore") != key()


def _secret(env, task):
    env.reset(task)
    return env._game.state.game_state["game_number"]


def test_envs_made_in_threads_of_a_fresh_process_all_know_their_game():
    """TextArena fills its registry game by game while the package imports: envs made at once in
    threads (an OpenEnv server makes each session's in a thread of its own) each waited for it."""
    import subprocess
    import sys

    code = ("import threading\n"
            "from saorl.envs.textarena_env import TextArenaEnv\n"
            "errors = []\n"
            "def make():\n"
            "    try:\n"
            "        TextArenaEnv(game='GuessTheNumber-v0-hardcore')\n"
            "    except Exception as e:\n"
            "        errors.append(repr(e))\n"
            "threads = [threading.Thread(target=make) for _ in range(8)]\n"
            "[t.start() for t in threads]\n"
            "[t.join() for t in threads]\n"
            "print(len(errors), errors[:1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0 []"
