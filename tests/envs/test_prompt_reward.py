import random
import sys

import pytest

from saorl.envs.base import Task
from saorl.envs.prompt_reward import PromptRewardEnv, RewardFunctionError
from saorl.envs.registry import make_env_factory
from saorl.envs.rewards import last_number, number_answer

from .episodes import play

REWARDS = '''
calls = []

def exact(prompt, completion, answer, **row):
    calls.append((prompt, completion, answer, row))
    return 1.0 if completion.strip() == str(answer) else 0.0

def length(prompt, completion, **row):
    return len(completion)

def returns(prompt, completion, value, **row):
    return value

def boom(prompt, completion, **row):
    raise KeyError("no such thing")

not_a_function = 42

def kw_only(prompt, completion, *, level, answer=0):
    return 1.0

def trl_solution(prompts, completions, solution, **kwargs):
    return [1.0]

def raises_on_level(prompt, completion, level="easy", **row):
    if level == "hard":
        raise KeyError("hard")
    return 1.0
'''
TASK = Task("t1", {"prompt": "What is 2+3?", "answer": 5, "level": "easy"})


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    import my_rewards

    yield my_rewards
    sys.modules.pop("my_rewards", None)


def test_reward_function_gets_prompt_completion_and_the_other_columns(rewards):
    env = PromptRewardEnv(reward_fn="my_rewards:exact")
    assert env.reset(TASK) == "What is 2+3?" and env.max_turns == 1
    (r,) = play(env, TASK, [" 5\n"])
    assert (r.reward, r.done, r.info["success"], r.observation) == (1.0, True, True, "")
    assert rewards.calls[-1] == ("What is 2+3?", " 5\n", 5, {"level": "easy"})
    (r,) = play(env, TASK, ["6"])
    assert (r.reward, r.info["success"]) == (0.0, False)


def test_threshold_prompt_column_and_stop_strings(rewards):
    env = PromptRewardEnv(reward_fn="my_rewards:length", success_threshold=3, stop=["</a>", "\n\n"])
    assert env.stop_strings == ("</a>", "\n\n") and PromptRewardEnv.stop_strings == ()
    (r,) = play(env, TASK, ["ab</a>xyz"])  # cut after the first stop string, which is kept
    assert r.reward == 6.0 and r.info["success"]  # len("ab</a>")
    (r,) = play(env, TASK, ["a\n\nb</a>"])
    assert r.reward == 3.0 and r.info["success"]
    (r,) = play(env, TASK, ["ab"])
    assert r.reward == 2.0 and not r.info["success"]
    other = PromptRewardEnv(reward_fn="my_rewards:exact", prompt_column="question")
    task = Task("q", {"question": "1+1?", "answer": 2})
    assert other.reset(task) == "1+1?"
    play(other, task, ["2"])
    assert rewards.calls[-1] == ("1+1?", "2", 2, {})


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_abc:f",
     "reward function 'no_such_module_abc:f': no module named 'no_such_module_abc'"),
    ("my_rewards:missing", "module 'my_rewards' has no attribute 'missing'"),
    ("my_rewards:not_a_function", "reward function 'my_rewards:not_a_function' is a int, not callable"),
    ("my_rewards", "must be 'module.path:function'"),
    (None, "reward_fn is required"),
])
def test_unusable_reward_functions_fail_when_the_env_is_built(rewards, spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make_env_factory("prompt_reward", {} if spec is None else {"reward_fn": spec})


@pytest.mark.parametrize("value", [None, "1.0", float("nan"), float("inf"), [1.0], 10**400])
def test_a_return_that_is_not_a_finite_number_names_the_function_and_the_row(rewards, value):
    env = PromptRewardEnv(reward_fn="my_rewards:returns")
    task = Task("row-9", {"prompt": "p", "value": value})
    with pytest.raises(RewardFunctionError) as info:
        play(env, task, ["x"])
    msg = str(info.value)
    assert "reward function 'my_rewards:returns' on task 'row-9'" in msg and "row {'value': " in msg
    assert "it must return a finite number" in msg or "it must return one finite number" in msg


def test_numbers_of_any_real_type_are_accepted(rewards):
    env = PromptRewardEnv(reward_fn="my_rewards:returns")
    for value, reward in [(1, 1.0), (True, 1.0), (0.25, 0.25)]:
        (r,) = play(env, Task("t", {"prompt": "p", "value": value}), ["x"])
        assert r.reward == reward and type(r.reward) is float


def test_a_raising_reward_function_is_named(rewards):
    env = PromptRewardEnv(reward_fn="my_rewards:boom")
    with pytest.raises(RewardFunctionError, match=r"'my_rewards:boom' on task 't1' .* raised KeyError"):
        play(env, TASK, ["x"])


def test_bad_rows_and_options(rewards):
    env = PromptRewardEnv(reward_fn="my_rewards:exact")
    with pytest.raises(ValueError, match=r"no prompt column 'prompt' \(columns: \['question'\]\)"):
        env.reset(Task("t", {"question": "q"}))
    with pytest.raises(ValueError, match=r"must hold non-empty text or a list of chat messages .*got int"):
        env.reset(Task("t", {"prompt": 3}))
    with pytest.raises(ValueError, match="column 'completion' clashes"):
        env.reset(Task("t", {"prompt": "p", "completion": "c"}))
    for kwargs, name in [({"prompt_column": ""}, "prompt_column"),
                         ({"success_threshold": "x"}, "success_threshold"), ({"stop": "\n"}, "stop"),
                         ({"demo_column": ""}, "demo_column")]:
        with pytest.raises(ValueError, match=name):
            PromptRewardEnv(reward_fn="my_rewards:exact", **kwargs)
    with pytest.raises(ValueError, match=r"no task generator: give your data with env\.tasks_file"):
        env.generate_tasks("train", 3, 0)


def test_demonstrations_come_from_a_column(rewards):
    rng = random.Random(0)
    with pytest.raises(NotImplementedError, match=r"sft\.enabled=false"):
        PromptRewardEnv(reward_fn="my_rewards:exact").demonstration(TASK, rng)
    env = PromptRewardEnv(reward_fn="my_rewards:exact", demo_column="solution")
    task = Task("t", {"prompt": "What is 2+3?", "answer": 5, "solution": "5"})
    (r,) = play(env, task, env.demonstration(task, rng))
    assert r.info["success"]
    with pytest.raises(ValueError, match="demo column 'solution' must hold non-empty text"):
        env.demonstration(TASK, rng)


def test_number_answer_hand_cases():
    assert last_number("so 3 + 4 = 7.") == 7.0
    assert last_number("Natalia sold 48/2 = 24 clips.\n#### 72") == 72.0
    assert last_number("total: 1,234 apples") == 1234.0 and last_number("-5") == -5.0
    assert last_number("no digits") is None
    assert number_answer("q", "The answer is 42", 42) == 1.0
    assert number_answer("q", "42 or maybe 41", 42) == 0.0
    assert number_answer("q", "It is 72.", "48 + 24 = 72\n#### 72") == 1.0
    assert number_answer("q", "nothing", 1, extra="ignored") == 0.0
    with pytest.raises(ValueError, match="holds no number"):
        number_answer("q", "1", "none")


def test_a_gsm8k_shaped_dataset_as_docs_envs_md_shows(tmp_path):
    """Columns ``question`` and ``answer`` (a worked solution ending ``#### N``), saved with
    save_to_disk and read through env.dataset, as the GSM8K command in docs/envs.md does."""
    datasets = pytest.importorskip("datasets")
    from saorl.config import load_config
    from saorl.data.tasks import load_split

    rows = [{"question": f"Tom has {i} apples and buys {i} more. How many?",
             "answer": f"He has {i} + {i} = {2 * i} apples.\n#### {2 * i}"} for i in range(1, 6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "gsm"))
    cfg = load_config(None, ["env.type=prompt_reward", f"env.dataset.path={tmp_path / 'gsm'}",
                             "env.options.prompt_column=question",
                             "env.options.reward_fn=saorl.envs.rewards:number_answer",
                             "env.options.demo_column=answer"])
    env = make_env_factory(cfg.env.type, cfg.env.options)()
    train = load_split(env, cfg.env, "train", None, 0)
    assert len(train) == 4 and len(load_split(env, cfg.env, "test", None, 0)) == 1
    for task in train:
        assert env.reset(task) == task.data["question"]
        (r,) = play(env, task, env.demonstration(task, random.Random(0)))
        assert r.reward == 1.0 and r.info["success"]
        (r,) = play(env, task, ["I think 3"])
        assert r.reward == 0.0


def test_the_columns_a_reward_function_takes_are_read_from_its_signature(rewards):
    from saorl.envs.reward_funcs import load_reward_fns

    fns = load_reward_fns(["my_rewards:exact", "my_rewards:kw_only", "my_rewards:trl_solution",
                           "my_rewards:length"])
    assert [f.required_columns for f in fns] == [("answer",), ("level",), ("solution",), ()]
    assert fns[0].missing_columns({"level": 1}) == ["answer"]


def test_a_row_without_a_column_the_reward_function_takes_stops_the_start_naming_file_and_row(
        rewards, tmp_path):
    """Found when the run starts (every row is reset once), not when the row is sampled."""
    import json

    from saorl.config import load_config
    from saorl.errors import StartupError
    from saorl.stages.preflight import check_tasks

    path = tmp_path / "tasks.jsonl"
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}, {"prompt": "3+3=", "level": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["env.type=prompt_reward", "env.options.reward_fn=my_rewards:exact",
                             f"env.tasks_file={path}", "env.num_test_tasks=1"])
    with pytest.raises(StartupError) as info:
        check_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options))
    msg = str(info.value)
    assert msg.startswith(f"{path}: row 3 (task id 'row-") and "\n" not in msg, msg
    assert ("the reward function 'my_rewards:exact' takes column 'answer' (a parameter without a default), "
            "which this row lacks (its columns: ['level'])") in msg


def test_a_row_that_fails_later_is_named_by_file_and_line(rewards, tmp_path):
    import json

    from saorl.data.tasks import load_tasks_jsonl

    path = tmp_path / "tasks.jsonl"
    lines = [json.dumps({"prompt": "p", "level": "easy"}), "", json.dumps({"prompt": "q", "level": "hard"})]
    path.write_text("\n".join(lines) + "\n")  # line 2 blank: the hard row is on line 3
    easy, hard = load_tasks_jsonl(path)
    env = PromptRewardEnv(reward_fn="my_rewards:raises_on_level")
    assert play(env, easy, ["x"])[0].reward == 1.0
    with pytest.raises(RewardFunctionError) as info:
        play(env, hard, ["x"])
    assert f"on task {hard.id!r} ({path}:3) (row {{'level': 'hard'}}) raised KeyError" in str(info.value)
