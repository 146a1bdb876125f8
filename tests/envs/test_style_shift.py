import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saorl.envs.base import Progress, Task
from saorl.envs.style_shift import DEMOS, LEXICONS, STYLES, StyleShiftEnv, score_text, style_score
from saorl.models.tokenizer import load_tokenizer

HAND = {
    "sweet": "My dear moon, you are so gentle and sweet to my heart.",
    "youthful": "Hey, the moon is so cool tonight! Totally awesome!",
    "classical": "O moon, thou art fair and thy light doth fall upon the sea.",
}
PLAIN = "The moon is up there and it is round."


@pytest.mark.parametrize("style", STYLES)
def test_hand_written_text_scores_highest_in_its_own_style(style):
    text = HAND[style]
    own, reason = score_text(text, "moon", style)
    assert reason is None and own == 1.0
    for other in STYLES:
        if other != style:
            assert score_text(text, "moon", other)[0] < 0.5
            assert score_text(HAND[other], "moon", style)[0] < own
    assert score_text(PLAIN, "moon", style)[0] < 0.5


def test_style_score_hand_computed():
    # two sweet words (0.75) + feature (my, no '!') 0.25 = 1.0; one youthful word costs 0.25
    assert style_score("my sweet dear moon", "sweet") == 1.0
    assert style_score("my sweet dear cool moon", "sweet") == 0.75
    # one lexicon word, no feature: 0.75 * 1/2
    assert style_score("the moon is sweet!", "sweet") == pytest.approx(0.375)
    # youthful feature needs 1..3 '!': 0.375 + 0.25
    assert style_score("the moon is cool!", "youthful") == pytest.approx(0.625)
    assert style_score("the moon is cool!!!!", "youthful") == pytest.approx(0.375)


@pytest.mark.parametrize("text, reason", [
    ("", "empty"),
    ("sweet moon", "too short"),
    ("sweet sweet sweet sweet moon is", "repetition"),
    ("the moon is cool and the moon is cool and nice", "repetition"),
    ("my dear moon, " + "you are so lovely and sweet and kind to me, " * 4, "too long"),
    ("!!! ??? ### moon is my sweet dear ***", "not mostly words"),
])
def test_degenerate_text_gets_zero(text, reason):
    for style in STYLES:
        assert score_text(text, "moon", style) == (0.0, reason)


def test_off_topic_and_word_bags_never_succeed():
    off = "My dear sun, you are so gentle and sweet to my heart."
    assert score_text(off, "moon", "sweet") == (pytest.approx(0.4), "off topic")
    bag = "sweet love dear heart honey moon"
    reward, reason = score_text(bag, "moon", "sweet")
    assert reason == "not a sentence" and reward < 0.5
    # plural topic counts as on topic
    assert score_text("My dear moons, you are so gentle and sweet.", "moon", "sweet")[0] == 1.0


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None)
def test_reward_is_always_in_unit_interval(text):
    env = StyleShiftEnv()
    task = env.generate_tasks("train", 1, 0)[0]
    env.reset(task)
    result = env.step(text)
    assert 0.0 <= result.reward <= 1.0 and result.done
    assert result.info["success"] == (result.reward >= 0.5)


def test_schedule_and_switch_points():
    env = StyleShiftEnv()
    got = [env.preferred_style(Progress(trainer_step=s)) for s in (0, 99, 100, 199, 200, 299, 300)]
    assert got == ["sweet", "sweet", "youthful", "youthful", "classical", "classical", "sweet"]
    assert env.preferred_style(None) == "sweet"
    assert env.switch_points(350) == [(0, "sweet"), (100, "youthful"), (200, "classical"), (300, "sweet")]
    assert env.switch_points(100) == [(0, "sweet")]
    custom = StyleShiftEnv(switch_every=10, schedule=["classical", "classical", "youthful"],
                           schedule_unit="episode")
    assert custom.preferred_style(Progress(trainer_step=999, episode=25)) == "youthful"
    assert custom.preferred_style(Progress(trainer_step=25, episode=5)) == "classical"
    assert custom.switch_points(45) == [(0, "classical"), (20, "youthful"), (30, "classical")]


def test_reward_follows_progress_and_prompt_does_not_leak_style():
    env = StyleShiftEnv()
    task = env.generate_tasks("train", 1, 0)[0]
    topic = task.data["topic"]
    text = HAND["youthful"].replace("moon", topic) + "\n"
    prompts, rewards = set(), []
    for step in (0, 100, 200):
        prompts.add(env.reset(task, Progress(trainer_step=step)))
        result = env.step(text)
        rewards.append(result.reward)
        assert result.info["style"] == env.preferred_style(Progress(trainer_step=step))
    assert len(prompts) == 1
    assert rewards[1] == 1.0 and rewards[0] < 0.5 and rewards[2] < 0.5
    words = set(prompts.pop().lower().replace(".", " ").replace(",", " ").split())
    assert not words & (set(STYLES) | set().union(*LEXICONS.values()))


def test_tasks_deterministic_disjoint_and_cycled():
    env = StyleShiftEnv()
    a, b = env.generate_tasks("train", 50, 3), env.generate_tasks("train", 50, 3)
    assert a == b and a != env.generate_tasks("train", 50, 4)
    train, test = env.generate_tasks("train", 500, 0), env.generate_tasks("test", 200, 0)
    assert len({t.id for t in train}) == 500 and len({t.id for t in test}) == 200
    assert not {t.id for t in train} & {t.id for t in test}
    content = lambda ts: {t.data["request"] for t in ts}  # noqa: E731
    assert not content(train) & content(test)
    assert 0.1 < len(content(test)) / (len(content(train)) + len(content(test))) < 0.35


def test_demonstrations_and_error_rate():
    rng = random.Random(0)
    env = StyleShiftEnv(demo_error_rate=0.0)
    tasks = env.generate_tasks("train", 60, 0)
    seen = set()
    for task in tasks:
        (action,) = env.demonstration(task, rng)
        assert action.endswith("\n")
        scores = {s: score_text(action.strip(), task.data["topic"], s)[0] for s in STYLES}
        best = [s for s, v in scores.items() if v >= 0.75]
        assert len(best) == 1 and all(v < 0.5 for s, v in scores.items() if s != best[0])
        seen.add(best[0])
    assert seen == set(STYLES)
    noisy = StyleShiftEnv(demo_error_rate=0.3)
    plain = 0
    for task in tasks * 5:
        text = noisy.demonstration(task, rng)[0].strip()
        plain += max(score_text(text, task.data["topic"], s)[0] for s in STYLES) < 0.5
    assert 0.2 < plain / 300 < 0.4
    assert all(t.format(t="x") for t in DEMOS["plain"])


def test_token_lengths_within_budget():
    tok = load_tokenizer()
    env = StyleShiftEnv(demo_error_rate=0.5)
    rng = random.Random(0)
    n = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    for task in env.generate_tasks("train", 80, 0):
        assert n(env.reset(task)) <= 60
        assert all(n(a) <= 40 for a in env.demonstration(task, rng))


def test_bad_options_and_misuse():
    with pytest.raises(ValueError, match="switch_every"):
        StyleShiftEnv(switch_every=0)
    with pytest.raises(ValueError, match="unknown styles"):
        StyleShiftEnv(schedule=["sweet", "grumpy"])
    with pytest.raises(ValueError, match="schedule_unit"):
        StyleShiftEnv(schedule_unit="epoch")
    with pytest.raises(TypeError, match="colour"):
        StyleShiftEnv(colour="red")
    env = StyleShiftEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("hello\n")


# ---------------------------------------------------------------- prompt-dependent scale, matched style


def test_topic_scale_spreads_the_reward_over_topics_and_leaves_success_alone():
    plain, scaled = StyleShiftEnv(), StyleShiftEnv(topic_scale=[0.2, 1.0])
    scales = sorted(scaled.scales.values())
    assert len(scales) == 40 and scales[0] == pytest.approx(0.2) and scales[-1] == pytest.approx(1.0)
    assert all(b - a == pytest.approx(0.8 / 39) for a, b in itertools.pairwise(scales))  # evenly spread
    assert StyleShiftEnv(topic_scale=[0.2, 1.0]).scales == scaled.scales  # fixed, not random per run
    for task in plain.generate_tasks("train", 40, 0):
        topic = task.data["topic"]
        text = HAND["sweet"].replace("moon", topic) + "\n"
        plain.reset(task)
        scaled.reset(task)
        a, b = plain.step(text), scaled.step(text)
        assert a.reward == 1.0 and a.info["scale"] == 1.0
        assert b.reward == pytest.approx(scaled.scales[topic]) and b.info["scale"] == scaled.scales[topic]
        assert a.info["success"] and b.info["success"]  # success reads the unscaled score
    for bad in ([0, 1], [1.0, 0.5], [0.5], "0.5,1", [0.5, "x"]):
        with pytest.raises(ValueError, match="topic_scale"):
            StyleShiftEnv(topic_scale=bad)


@pytest.mark.parametrize("preferred_step, preferred", [(0, "sweet"), (100, "youthful")])
def test_info_says_which_style_the_sample_matched(preferred_step, preferred):
    env = StyleShiftEnv()
    task = env.generate_tasks("train", 1, 0)[0]
    topic = task.data["topic"]
    for text, matched in [(HAND["sweet"], "sweet"), (HAND["youthful"], "youthful"),
                          (HAND["classical"], "classical"), (PLAIN, "none"), ("", "none")]:
        env.reset(task, Progress(trainer_step=preferred_step))
        info = env.step(text.replace("moon", topic) + "\n").info
        assert info["matched_style"] == matched
        assert info["metrics"] == {"matched_sweet": float(matched == "sweet"),
                                   "matched_youthful": float(matched == "youthful"),
                                   "matched_classical": float(matched == "classical"),
                                   "matched_preferred": float(matched == preferred)}


def test_a_tie_at_one_half_matches_no_style():
    # two sweet words + 'my' (sweet feature), two classical words, ends with '.' (classical feature):
    # each style scores 0.75 + 0.25 - 2 * 0.25 = 0.5
    text = "My sweet dear moon doth shine and thus the night is done."
    scores = {s: score_text(text, "moon", s)[0] for s in STYLES}
    assert scores["sweet"] == scores["classical"] == 0.5
    env = StyleShiftEnv()
    env.reset(Task("t", {"topic": "moon", "request": "Write a line about the moon."}))
    info = env.step(text + "\n").info
    assert info["matched_style"] == "none" and info["metrics"]["matched_preferred"] == 0.0
    assert info["success"]  # sweet is preferred at step 0 and scores 0.5
