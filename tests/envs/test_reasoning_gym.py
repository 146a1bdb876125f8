"""``reasoning_gym`` against the real reasoning-gym package: its problems, its scorer, its prompt."""

from __future__ import annotations

import pytest

from saorl.envs.registry import make_env_factory

from .community import need
from .episodes import play

rg = need("reasoning_gym")

EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _env(**options):
    return make_env_factory("reasoning_gym", {"dataset": "basic_arithmetic", "config": EASY, **options})()


def test_tasks_are_the_datasets_problems_and_its_scorer_gives_the_reward():
    env = _env()
    tasks = env.generate_tasks("train", 6, seed=3)
    dataset = rg.create_dataset("basic_arithmetic", seed=3, size=1000, **EASY)
    for task in tasks:
        entry = dataset[task.data["index"]]
        assert (task.data["question"], task.data["answer"]) == (entry["question"], entry["answer"])
    task = tasks[0]
    entry = dataset[task.data["index"]]
    wrong = str(int(entry["answer"]) + 1)
    for text in (f"so <answer>{entry['answer']}</answer>", f"<answer>{wrong}</answer>", entry["answer"],
                 f"<answer>{wrong}</answer> no, <answer>{entry['answer']}</answer>"):
        (result,) = play(env, task, [text])
        expect = dataset.score_answer(rg.utils.extract_answer(text), entry)
        assert result.done and result.reward == expect and result.info["success"] == (expect >= 1.0)
    right = "<answer>" + entry["answer"] + "</answer>"
    assert [play(env, task, [t])[0].reward for t in (right, "x")] == [1.0, 0.0]


def test_prompt_states_the_answer_format_as_reasoning_gym_does():
    env = _env()
    task = env.generate_tasks("test", 1, seed=0)[0]
    system, user = env.reset(task)
    assert system == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]}
    assert user == {"role": "user", "content": task.data["question"]}
    text = _env(prompt="text", system_prompt="direct").reset(task)
    assert text == rg.utils.SYSTEM_PROMPTS["direct"] + "\n" + task.data["question"]
    assert _env().stop_strings == ("</answer>",)


def test_splits_are_disjoint_and_deterministic_in_the_seed():
    env = _env()
    train, test = env.generate_tasks("train", 60, seed=1), env.generate_tasks("test", 30, seed=1)
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {t.data["question"] for t in train} & {t.data["question"] for t in test}
    assert env.generate_tasks("train", 60, seed=1) == train
    assert env.generate_tasks("train", 60, seed=2) != train


def test_bad_options_are_one_paragraph_each():
    with pytest.raises(ValueError, match=r"did you mean 'basic_arithmetic'"):
        make_env_factory("reasoning_gym", {"dataset": "basic_arithmetc"})
    with pytest.raises(ValueError, match=r"config.seed: the tasks' seeds .* come from the run"):
        make_env_factory("reasoning_gym", {"dataset": "countdown", "config": {"seed": 3}})
    with pytest.raises(ValueError, match=r"not a config of 'countdown'.*unexpected keyword argument 'foo'"):
        make_env_factory("reasoning_gym", {"dataset": "countdown", "config": {"foo": 1}})
    with pytest.raises(ValueError, match=r"system_prompt 'nope' is not one of reasoning-gym's"):
        make_env_factory("reasoning_gym", {"dataset": "countdown", "system_prompt": "nope"})


def test_chat_prompts_for_a_tokenizer_without_a_template_stop_the_start():
    from saorl.config import config_from_dict
    from saorl.errors import StartupError
    from saorl.stages.env_check import check_env
    from saorl.stages.preflight import check_tasks

    env = {"type": "reasoning_gym", "options": {"dataset": "chain_sum"}, "num_test_tasks": 4}
    cfg = config_from_dict({"env": env})  # the tiny model's shipped tokenizer has no chat template
    with pytest.raises(StartupError, match=r"env reasoning_gym, task 'chain_sum-\w+': the prompt is a "
                                           r"conversation .* env.options.prompt=text"):
        check_tasks(cfg, check_env(cfg))
    cfg = config_from_dict({"env": {**env, "options": {"dataset": "chain_sum", "prompt": "text"}}})
    check_tasks(cfg, check_env(cfg))


def test_answers_that_a_scorer_would_evaluate_are_refused_and_never_run(capsys):
    spiral = make_env_factory("reasoning_gym", {"dataset": "spiral_matrix"})()
    task = spiral.generate_tasks("train", 1, seed=0)[0]
    pwned = '<answer>__import__("sys").stdout.write("PWNED\\n") and []</answer>'
    countdown = make_env_factory("reasoning_gym", {"dataset": "countdown"})()
    ctask = countdown.generate_tasks("train", 1, seed=0)[0]
    for env, t, text in ((spiral, task, pwned), (spiral, task, "<answer>[9**9**9**9]</answer>"),
                         (countdown, ctask, "<answer>9**9**9**9</answer>"),
                         (countdown, ctask, "<answer>[0]*9999999999</answer>")):
        (result,) = play(env, t, [text])
        assert result.done and result.reward == 0.0 and result.info["metrics"]["answers_refused"] == 1.0
        assert result.info["refused"] and result.observation.startswith("Refused: ")
    assert "PWNED" not in capsys.readouterr().out
    for env, t in ((spiral, task), (countdown, ctask)):  # a right ordinary answer still scores 1
        (result,) = play(env, t, [f"<answer>{t.data['answer']}</answer>"])
        assert result.reward == 1.0 and result.info["metrics"]["answers_refused"] == 0.0
    from saorl.envs.reasoning_gym_env import refusal

    assert refusal("1 " * 1500, "spiral_matrix") and refusal("Move disk 1\n" * 300, "tower_of_hanoi") is None
    assert refusal("6769988418200343.0", "power_function") is None and refusal("9" * 16, "countdown")
    import reasoning_gym.algorithmic.spiral_matrix as module

    assert module.eval("[1, 2]") == [1, 2]
    with pytest.raises(ValueError):
        module.eval('print("PWNED")')


def test_rewarded_but_wrong_replies_are_counted():
    # the default scorer's partial credit: a reply that contains the oracle answer earns a share
    env = _env()
    task = env.generate_tasks("test", 1, seed=5)[0]
    answer = task.data["answer"]
    cases = {f"<answer>{answer}</answer>": (1.0, 0.0), f"<answer>9{answer}</answer>": (None, 1.0),
             "<answer>no idea</answer>": (0.0, 0.0), "no tag": (0.0, 0.0)}
    for text, (reward, gamed) in cases.items():
        (result,) = play(env, task, [text])
        assert result.info["metrics"]["rewarded_wrong"] == gamed, text
        if reward is None:  # partial: len(answer) / len(9answer), rewarded and not a success
            assert result.reward == pytest.approx(len(answer) / (len(answer) + 1))
            assert not result.info["success"]
        else:
            assert result.reward == reward
