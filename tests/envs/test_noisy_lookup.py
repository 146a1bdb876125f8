import asyncio
import random
import statistics

import pytest
import torch

from saorl.agent.scripted import demonstration_trajectory
from saorl.algo.gae import skip_observation_gae, token_gae
from saorl.data.batch import collate
from saorl.envs.base import Task
from saorl.envs.noisy_lookup import NAMES, NOISE, NoisyLookupEnv, noise_text
from saorl.envs.synthetic import turns_distribution
from saorl.models.tokenizer import load_tokenizer

from .episodes import play

TASK = Task("noisy_lookup/k3/x", {"names": ["kiwi", "fig", "tea"], "codes": [417, 902, 133]})


def _code_in(observation: str, name: str) -> int:
    (pair,) = [w for w in observation.removeprefix("<out>").split("</out>")[0].split() if "=" in w]
    key, code = pair.split("=")
    assert key == name
    return int(code)


def test_tasks_deterministic_disjoint_and_long_tailed():
    env = NoisyLookupEnv()
    a = env.generate_tasks("train", 400, 0)
    assert a == env.generate_tasks("train", 400, 0) and a != env.generate_tasks("train", 400, 1)
    test = env.generate_tasks("test", 400, 0)
    assert len({t.id for t in a}) == 400 and not {t.id for t in a} & {t.id for t in test}
    content = lambda ts: {(*t.data["names"], *t.data["codes"]) for t in ts}  # noqa: E731
    assert not content(a) & content(test)
    ks = [len(t.data["names"]) for t in a + test]
    for t in a:
        names, codes = t.data["names"], t.data["codes"]
        assert len(set(names)) == len(names) == len(codes) and set(names) <= set(NAMES)
        assert all(100 <= c <= 999 for c in codes) and t.id.startswith(f"noisy_lookup/k{len(names)}/")
    # k follows the clipped lognormal: the empirical frequencies match turns_distribution
    p = turns_distribution(3.0, 1.0, 8)
    for k in (1, 2, 3, 8):
        assert abs(ks.count(k) / len(ks) - p[k]) < 0.05, (k, ks.count(k) / len(ks), p[k])
    assert max(ks) == 8 and statistics.median(ks) <= 3  # long-tailed: the tail is far above the median


def test_observations_carry_the_code_among_noise_deterministically():
    env = NoisyLookupEnv(noise_words=20)
    assert env.reset(TASK) == "Look up, in order:\nkiwi\nfig\ntea\n"
    first = env.step("<tool>fig</tool>")
    assert not first.done and first.reward == 0.0 and _code_in(first.observation, "fig") == 902
    words = first.observation.removeprefix("<out>").removesuffix("</out>\n").split()
    assert len(words) == 21 and sum(w in NOISE for w in words) >= 10
    env.reset(TASK)
    assert env.step("<tool>fig</tool>").observation == first.observation  # replayable
    assert env.step("<tool>fig</tool>").observation != first.observation  # the next call's noise differs
    assert noise_text("s", 5) == noise_text("s", 5) and len(noise_text("s", 0)) == 0
    quiet = NoisyLookupEnv(noise_words=0)
    quiet.reset(TASK)
    assert quiet.step("<tool>kiwi</tool>").observation == "<out>kiwi=417</out>\n"


def test_without_hex_ids_the_code_is_the_only_digits_in_an_observation():
    def digit_words(env):
        env.reset(TASK)
        words = [env.step(f"<tool>{n}</tool>").observation for n in TASK.data["names"]]
        return [w for obs in words for w in obs.removeprefix("<out>").split("</out>")[0].split()
                if any(c.isdigit() for c in w)]

    only_codes = digit_words(NoisyLookupEnv(noise_words=40, hex_ids=False))
    assert sorted(only_codes) == ["fig=902", "kiwi=417", "tea=133"]
    assert len(digit_words(NoisyLookupEnv(noise_words=40))) > 3  # the default filler has hex ids with digits
    plain = noise_text("s", 200, hex_ids=False)
    assert len(plain) == 200 and set(plain) <= set(NOISE) and plain == noise_text("s", 200, hex_ids=False)


def test_rewards_on_hand_made_actions():
    env = NoisyLookupEnv()
    calls = ["<tool>kiwi</tool>", "<tool>fig</tool>", "<tool>tea</tool>"]
    *obs, end = play(env, TASK, [*calls, "<answer>417 902 133</answer>"])
    assert [o.reward for o in obs] == [0.0, 0.0, 0.0] and not any(o.done for o in obs)
    assert (end.reward, end.done, end.info["success"], end.info["calls"]) == (1.0, True, True, 3)
    (end,) = play(env, TASK, ["<answer>417 902 133</answer>"])  # guessing right is allowed
    assert end.reward == 1.0 and end.info["calls"] == 0
    cases = [("417 902 134", 2 / 3), ("417 902", 2 / 3), ("417 902 133 555", 3 / 4), ("133 902 417", 1 / 3),
             ("417,902,133", 0.0), ("", 0.0), ("41 902 133", 0.0)]
    for answer, reward in cases:
        (end,) = play(env, TASK, [f"<answer>{answer}</answer>"])
        assert end.done and end.reward == pytest.approx(reward) and not end.info["success"], answer


def test_grade_calls_rewards_the_lookups_not_the_codes():
    env = NoisyLookupEnv(grade="calls", extra_turns=2)
    calls = ["<tool>kiwi</tool>", "<tool>fig</tool>", "<tool>tea</tool>"]
    *_, end = play(env, TASK, [*calls, "<answer>111 222 333</answer>"])  # wrong codes, right lookups
    assert (end.reward, end.info["success"], end.info["error"]) == (1.0, True, None)
    cases = [  # (calls, answer, reward)
        (["kiwi", "tea"], "111", 1 / 3),                      # skipped fig: tea is at fig's position
        (["kiwi", "fig"], "417 902", 2 / 3),                  # one missing
        (["fig", "kiwi", "tea"], "417 902 133", 1 / 3),       # out of order
        (["kiwi", "pear", "fig", "tea"], "417 902 133", 1 / 4),  # an unknown name counts as a call
        (["kiwi", "fig", "tea", "tea"], "417 902 133", 3 / 4),   # an extra call
        ([], "417 902 133", 0.0),                             # right codes, no lookups
        (["kiwi", "fig", "tea"], "done", 0.0),                # an answer must still be codes
    ]
    for names, answer, reward in cases:
        *_, end = play(NoisyLookupEnv(grade="calls", extra_turns=2), TASK,
                       [*(f"<tool>{n}</tool>" for n in names), f"<answer>{answer}</answer>"])
        assert end.done and end.reward == pytest.approx(reward) and not end.info["success"], (names, answer)
    env = NoisyLookupEnv(grade="calls", extra_turns=1)  # out of turns: 0, as with codes
    *_, end = play(env, TASK, [*calls, "<tool>kiwi</tool>"])
    assert end.done and end.reward == 0.0 and "out of turns" in end.info["error"]
    *_, end = play(env, TASK, [*calls, "<answer>111 222 333</answer>"])  # reset forgets the last calls
    assert end.reward == 1.0
    rng, tok = random.Random(0), load_tokenizer()  # demonstrations look up every name in order
    for task in env.generate_tasks("train", 20, 0):
        traj = asyncio.run(demonstration_trajectory(NoisyLookupEnv(grade="calls"), task, tok, rng))
        assert traj.total_reward == 1.0


def test_mistakes_cost_turns_and_the_turn_limit_ends_the_episode():
    env = NoisyLookupEnv(extra_turns=1)
    assert env.max_turns == 8 + 1
    env.reset(TASK)
    unknown = env.step("<tool>pear</tool>")
    assert unknown.observation == "<out>error: unknown name 'pear'</out>\n" and not unknown.done
    bad = env.step("kiwi")
    assert bad.observation.startswith("<out>error: expected <tool>") and not bad.done
    env.step("<tool>kiwi</tool>")
    last = env.step("<tool>fig</tool>")  # turn 4 = k + extra_turns: over
    assert last.done and last.reward == 0.0 and "out of turns (4)" in last.info["error"]
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<answer>1</answer>")


def test_bad_options_and_tasks():
    for kwargs, name in [({"mean_calls": 0.5}, "mean_calls"), ({"cv": -1}, "cv"),
                         ({"max_calls": 0}, "max_calls"), ({"max_calls": 999}, "max_calls"),
                         ({"noise_words": -1}, "noise_words"),
                         ({"extra_turns": 0}, "extra_turns"), ({"demo_error_rate": 2}, "demo_error_rate"),
                         ({"hex_ids": "no"}, "hex_ids"), ({"hex_ids": 0}, "hex_ids"),
                         ({"grade": "names"}, "grade"), ({"grade": None}, "grade")]:
        with pytest.raises(ValueError, match=name):
            NoisyLookupEnv(**kwargs)
    with pytest.raises(ValueError, match="not a noisy_lookup task"):
        NoisyLookupEnv().reset(Task("x", {"names": ["a"], "codes": []}))


def test_demonstrations_succeed_or_fail_by_one_typo():
    rng = random.Random(0)
    tasks = NoisyLookupEnv().generate_tasks("train", 60, 0)
    good = NoisyLookupEnv(demo_error_rate=0.0)
    bad = NoisyLookupEnv(demo_error_rate=1.0)
    for task in tasks:
        k = len(task.data["names"])
        results = play(good, task, good.demonstration(task, rng))
        assert len(results) == k + 1 and results[-1].info["success"] and results[-1].reward == 1.0
        results = play(bad, task, bad.demonstration(task, rng))
        assert not results[-1].info["success"] and results[-1].reward == pytest.approx((k - 1) / k)


def _name_tokens(tok, text: str, name: str, start: int) -> list[str]:
    """The tokens of ``text`` whose characters lie in ``name``, found at or after ``start``."""
    at = text.index(name, start)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [i for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if a >= at and b <= at + len(name)]
    return tok.convert_ids_to_tokens(ids)


def test_the_prompt_and_the_call_spell_every_name_with_the_same_tokens():
    """Copying a name from the prompt into ``<tool>name</tool>`` is a plain token copy with the
    shipped tokenizer, for every name and position (a space-separated list would not be: the
    first piece would carry the space marker)."""
    tok = load_tokenizer()
    env = NoisyLookupEnv()
    for i in range(0, len(NAMES), 3):
        names = list(NAMES[i:i + 3])
        prompt = env.reset(Task("noisy_lookup/x", {"names": names, "codes": [100] * len(names)}))
        for name in names:
            in_prompt = _name_tokens(tok, prompt, name, prompt.index(":"))
            call = f"<tool>{name}</tool>"
            assert in_prompt == _name_tokens(tok, call, name, 0) and in_prompt, (name, in_prompt)
    spaced = "Look up: kiwi fig."  # the old format, for contrast
    assert _name_tokens(tok, spaced, "fig", 0) != _name_tokens(tok, "<tool>fig</tool>", "fig", 0)


def test_skip_observation_and_plain_gae_differ_by_design():
    """gamma = 1, lambda = 0.95, V = 0, reward 1 at the end: the first action's advantage is
    lambda^(action tokens after it) under skip-observation GAE and lambda^(response tokens after
    it) under plain GAE; the noisy observations make the second far smaller, more so for larger k."""
    tok = load_tokenizer()
    env = NoisyLookupEnv(demo_error_rate=0.0)
    by_k = {}
    for task in env.generate_tasks("train", 200, 0):
        by_k.setdefault(len(task.data["names"]), task)
    ratios = {}
    for k in (1, 3, 6):
        traj = asyncio.run(demonstration_trajectory(NoisyLookupEnv(demo_error_rate=0.0), by_k[k], tok,
                                                    random.Random(0)))
        assert traj.total_reward == 1.0 and traj.episode.turns == k + 1
        b = collate([traj], tok.pad_token_id)
        values = torch.zeros_like(b.rewards)
        skip, _ = skip_observation_gae(b.rewards, values, b.action_mask, 1.0, 0.95)
        plain, _ = token_gae(b.rewards, values, b.response_mask, 1.0, 0.95)
        first = traj.prompt_len
        n_act, n_resp = traj.num_action_tokens, len(traj) - traj.prompt_len
        assert skip[0, first].item() == pytest.approx(0.95 ** (n_act - 1), rel=1e-5)
        assert plain[0, first].item() == pytest.approx(0.95 ** (n_resp - 1), rel=1e-5)
        obs_tokens = n_resp - n_act
        assert obs_tokens >= 40 * k  # tens of noise tokens per call
        ratios[k] = plain[0, first].item() / skip[0, first].item()
    assert ratios[1] < 0.2 and ratios[3] < 0.01 and ratios[6] < ratios[3] < ratios[1]
