"""``prompt_reward`` with a TRL user's data and rewards: conversational prompts (real parquet and
``datasets`` files), TRL's batched reward functions, several of them weighted, and the errors a
wrong signature or return value gets."""

from __future__ import annotations

import asyncio
import sys

import pytest

from saorl.agent.loop import run_episode
from saorl.agent.scripted import ScriptedEngine
from saorl.data.tasks import read_tasks
from saorl.engines.base import SamplingParams
from saorl.envs.base import Task
from saorl.envs.prompt_reward import PromptRewardEnv, RewardFunctionError
from saorl.envs.registry import make_env_factory
from saorl.envs.reward_funcs import is_batched
from saorl.envs.rewards import number_answer
from saorl.models.codec import RunTokenizer
from saorl.models.tokenizer import load_tokenizer

from .episodes import play

# TRL's documented examples (docs/source/grpo_trainer.md), unchanged, and saorl-style ones
REWARDS = '''
import asyncio
import re

calls = []

def reward_len(completion_ids, **kwargs):
    """TRL example 1: longer completions (in tokens)."""
    calls.append(("reward_len", kwargs, completion_ids))
    return [float(len(ids)) for ids in completion_ids]

def format_reward_func(completions, **kwargs):
    """TRL example 2 (conversational): 1 when the completion is <think>...</think><answer>...</answer>."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in completion_contents]

def math_reward_func(prompts, completions, task, **kwargs):
    """TRL's mixed-task example: None for rows it does not score."""
    calls.append(("math", prompts, completions, task, kwargs))
    return [1.0 if t == "math" else None for t in task]

def code_reward_func(prompts, completions, task, **kwargs):
    return [0.5 if t == "code" else None for t in task]

def never(prompts, completions, **kwargs):
    return [None for _ in completions]

def per_sample(prompt, completion, answer, **row):
    calls.append(("per_sample", prompt, completion, answer, row))
    return 1.0 if str(answer) in str(completion) else 0.0

def keyword_only(**kwargs):
    return [2.0 for _ in kwargs["completions"]]

def one_per_char(prompts, completions, **kwargs):
    """Batched, but returns a value per character (a bug in the function)."""
    return [0.0 for _ in completions[0]]

def scalar(prompts, completions, **kwargs):
    return 0.5

def nan_in_a_list(prompts, completions, **kwargs):
    return [float("nan")]

def a_list(prompt, completion, **row):
    return [1.0]

def needs_state(prompts, completions, trainer_state, **kwargs):
    return [0.0]

def state_optional(prompts, completions, trainer_state=None, log_metric=None, **kwargs):
    return [float(trainer_state is None and log_metric is None)]

def numpy_batch(prompts, completions, **kwargs):
    import numpy as np
    return np.array([0.25], dtype=np.float32)

def torch_batch(prompts, completions, **kwargs):
    import torch
    return torch.tensor([0.5])

def numpy_scalar(prompt, completion, **row):
    import numpy as np
    return np.float32(0.75)

async def async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [3.0 for _ in completions]
'''
CHAT = [{"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "What is 2+3?"}]
QWEN3_STYLE = (  # Qwen3's template in miniature: system first, ChatML turns, enable_thinking
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{%- if m.role != 'system' %}{{- '<|im_start|>' "
    "+ m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt "
    "%}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "trl_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("trl_rewards", None)
    import trl_rewards

    yield trl_rewards
    sys.modules.pop("trl_rewards", None)


def chat_tokenizer(**kwargs) -> RunTokenizer:
    hf = load_tokenizer()
    hf.chat_template = QWEN3_STYLE
    from saorl.models.codec import TokenizerSpec

    return RunTokenizer(hf, TokenizerSpec(None, True, kwargs))


def episode(env, task, tok, action):
    engine = ScriptedEngine(tok, [action])
    return asyncio.run(run_episode(engine, env, task, tok, sampling=SamplingParams(max_new_tokens=24),
                                   max_total_tokens=256))


def test_conversational_parquet_rows_render_through_the_chat_template_system_message_included(
        tmp_path, rewards):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": CHAT, "answer": 5},
            {"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": 2}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    tasks = read_tasks(tmp_path / "train.parquet")
    assert [t.data for t in tasks] == rows
    env = PromptRewardEnv(reward_fn="trl_rewards:per_sample")
    assert env.reset(tasks[0]) == CHAT
    tok = chat_tokenizer(enable_thinking=False)
    traj = episode(env, tasks[0], tok, "It is 5.")
    assert tok.text(traj.token_ids[:traj.prompt_len]) == (
        "<|im_start|>system\nYou are a careful calculator.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert traj.episode.final_reward == 1.0
    # the reward function gets the prompt and completion as TRL passes them for conversational data
    assert rewards.calls[-1] == ("per_sample", CHAT, [{"role": "assistant", "content": "It is 5."}], 5, {})


def test_a_datasets_directory_of_conversations_and_number_answer(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                        {"role": "user", "content": f"What is {i}+{i}?"}], "answer": 2 * i} for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    tasks = read_tasks(tmp_path / "ds")
    env = PromptRewardEnv(reward_fn="saorl.envs.rewards:number_answer")
    assert [env.reset(t) for t in tasks] == [r["prompt"] for r in rows]
    traj = episode(env, tasks[2], chat_tokenizer(), "4")
    assert traj.episode.final_reward == 1.0
    assert number_answer(CHAT, [{"role": "assistant", "content": "so 7"}], 7) == 1.0


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt column 'prompt' is an empty list"),
    ([{"content": "hi"}], r"message 1 has no role \(keys: \['content'\]\)"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}],
     r"message 2 \(user\) has content of type list; it must be text"),
    ([{"role": "user", "content": None}], "message 1 .* content of type NoneType"),
    (["hi"], "message 1 is a str, not a {role, content} object"),
])
def test_malformed_messages_are_named(rewards, prompt, message):
    env = PromptRewardEnv(reward_fn="trl_rewards:per_sample")
    with pytest.raises(ValueError, match=rf"task 'r7': .*{message}"):
        env.reset(Task("r7", {"prompt": prompt, "answer": 1}))


def test_keys_holding_none_are_dropped_from_messages(rewards):
    """A field only some messages have (``name``) reads back from parquet as None in the others."""
    env = PromptRewardEnv(reward_fn="trl_rewards:per_sample")
    prompt = [{"role": "system", "content": "s", "name": None},
              {"role": "user", "content": "u", "name": "bob"}]
    assert env.reset(Task("t", {"prompt": prompt, "answer": 1})) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "bob"}]


def test_which_functions_are_called_trl_style(rewards):
    r = rewards
    assert all(map(is_batched, (r.reward_len, r.format_reward_func, r.math_reward_func, r.keyword_only)))
    assert not any(is_batched(f) for f in (r.per_sample, r.a_list, number_answer, len))
    assert not is_batched(lambda p, c, **row: 0.0)


def test_trl_functions_get_lists_of_one_with_the_columns_and_completion_ids(rewards):
    env = PromptRewardEnv(reward_fn=["trl_rewards:reward_len", "trl_rewards:math_reward_func"])
    task = Task("t", {"prompt": "2+3 =", "task": "math", "answer": 5})
    tok = RunTokenizer(load_tokenizer())
    traj = episode(env, task, tok, " 5")
    action_ids = traj.token_ids[traj.prompt_len:]  # " 5" and eos, as sampled
    name, kwargs, ids = rewards.calls[0]
    assert (name, ids) == ("reward_len", [action_ids]) and action_ids[-1] == tok.eos_token_id
    assert kwargs == {"prompts": ["2+3 ="], "completions": [" 5"], "task": ["math"], "answer": [5]}
    assert rewards.calls[1][1:4] == (["2+3 ="], [" 5"], ["math"])
    assert traj.episode.final_reward == len(action_ids) + 1.0
    assert traj.episode.env_metrics == {"reward/reward_len": float(len(action_ids)),
                                        "reward/math_reward_func": 1.0}
    # stepped as text only (saorl envs sample, these tests' play): no ids
    (res,) = play(PromptRewardEnv(reward_fn="trl_rewards:math_reward_func"), task, [" 5"])
    assert rewards.calls[-1][4]["completion_ids"] == [None] and res.reward == 1.0


def test_weights_none_and_per_function_metrics(rewards):
    """TRL's weighted sum; None = the function does not score this row (TRL's NaN under nansum)."""
    env = PromptRewardEnv(reward_fn=["trl_rewards:math_reward_func", "trl_rewards:code_reward_func",
                                     "trl_rewards:keyword_only"], reward_weights=[2.0, 4.0, 0.25])
    (res,) = play(env, Task("m", {"prompt": "p", "task": "math"}), ["x"])
    assert res.reward == 2.0 * 1.0 + 0.25 * 2.0 and res.info["success"]
    assert res.info["metrics"] == {"reward/math_reward_func": 1.0, "reward/keyword_only": 2.0}
    (res,) = play(env, Task("c", {"prompt": "p", "task": "code"}), ["x"])
    assert res.reward == 4.0 * 0.5 + 0.25 * 2.0
    assert res.info["metrics"] == {"reward/code_reward_func": 0.5, "reward/keyword_only": 2.0}
    twice = PromptRewardEnv(reward_fn=["trl_rewards:keyword_only", "trl_rewards:keyword_only"])
    (res,) = play(twice, Task("t", {"prompt": "p"}), ["x"])
    assert res.reward == 4.0
    assert res.info["metrics"] == {"reward/keyword_only": 2.0, "reward/keyword_only_2": 2.0}


def test_arrays_and_tensors_are_taken_as_trl_takes_them(rewards):
    env = PromptRewardEnv(reward_fn=["trl_rewards:numpy_batch", "trl_rewards:torch_batch",
                                     "trl_rewards:numpy_scalar"])
    (res,) = play(env, Task("t", {"prompt": "p"}), ["x"])
    assert res.reward == 1.5 and type(res.reward) is float
    assert res.info["metrics"] == {"reward/numpy_batch": 0.25, "reward/torch_batch": 0.5,
                                   "reward/numpy_scalar": 0.75}


def test_a_completion_no_function_scores_is_an_error_naming_them(rewards):
    env = PromptRewardEnv(reward_fn=["trl_rewards:math_reward_func", "trl_rewards:code_reward_func"])
    with pytest.raises(RewardFunctionError, match=r"no reward function scored task 'x' \(row \{'task': "
                       r"'prose'\}\): 'trl_rewards:math_reward_func', 'trl_rewards:code_reward_func' all "
                       r"returned None"):
        play(env, Task("x", {"prompt": "p", "task": "prose"}), ["y"])
    with pytest.raises(RewardFunctionError, match=r"'trl_rewards:never' on task 'x' .* returned None"):
        play(PromptRewardEnv(reward_fn="trl_rewards:never"), Task("x", {"prompt": "p"}), ["y"])


@pytest.mark.parametrize("spec, returned, expected", [
    ("one_per_char", r"\[0\.0, 0\.0, 0\.0\] \(list\)",
     "a list of one finite number or None (it got one completion, and returned 3 values)"),
    ("scalar", r"0\.5 \(float\)", "a list of one finite number or None"),
    ("a_list", r"\[1\.0\] \(list\)", "one finite number or None, not a list"),
    ("nan_in_a_list", r"\[nan\] \(list\)", "a list of one finite number or None"),
])
def test_a_wrong_shape_is_one_paragraph_naming_the_function_and_the_signature(rewards, spec, returned,
                                                                              expected):
    env = PromptRewardEnv(reward_fn=f"trl_rewards:{spec}")
    with pytest.raises(RewardFunctionError) as info:
        play(env, Task("t9", {"prompt": "p", "answer": "nope"}), ["abc"])
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"reward function 'trl_rewards:{spec}' on task 't9'")
    assert __import__("re").search(f"returned {returned}", msg)
    assert f"it must return {expected}" in msg
    if spec != "a_list":
        assert f"trl_rewards:{spec}(prompts=[...], completions=[...], completion_ids=[...], **columns)" in msg
        assert "env.options.reward_call=per_sample" in msg
    else:
        assert "trl_rewards:a_list(prompt, completion, **row)" in msg and "reward_call=batched" in msg


def test_reward_call_overrides_the_rule(rewards):
    # keyword_only is batched by the rule; per_sample forces the saorl call, which it cannot take
    env = PromptRewardEnv(reward_fn="trl_rewards:keyword_only", reward_call="per_sample")
    with pytest.raises(RewardFunctionError, match="raised TypeError"):
        play(env, Task("t", {"prompt": "p"}), ["x"])


def test_arguments_trl_passes_and_saorl_does_not_and_async_functions(rewards):
    with pytest.raises(ValueError, match=r"'trl_rewards:needs_state' requires trainer_state, which TRL "
                       r"passes and saorl does not .* give it a default \(e\.g\. trainer_state=None\)"):
        make_env_factory("prompt_reward", {"reward_fn": "trl_rewards:needs_state"})
    (res,) = play(PromptRewardEnv(reward_fn="trl_rewards:state_optional"), Task("t", {"prompt": "p"}), ["x"])
    assert res.reward == 1.0
    (res,) = play(PromptRewardEnv(reward_fn="trl_rewards:async_reward"), Task("t", {"prompt": "p"}), ["x"])
    assert res.reward == 3.0


@pytest.mark.parametrize("options, message", [
    ({"reward_fn": []}, "non-empty list"),
    ({"reward_fn": ["trl_rewards:scalar", "nocolon"]}, "must be 'module.path:function'"),
    ({"reward_fn": ["trl_rewards:scalar"], "reward_weights": [1, 2]}, "must be a list of 1 finite"),
    ({"reward_fn": "trl_rewards:scalar", "reward_weights": ["1"]}, "reward_weights must be a list of 1"),
    ({"reward_fn": "trl_rewards:scalar", "reward_weights": [float("nan")]}, "reward_weights must be"),
    ({"reward_fn": "trl_rewards:scalar", "reward_call": "trl"}, "must be auto, batched or per_sample"),
])
def test_bad_reward_options_fail_when_the_env_is_built(rewards, options, message):
    with pytest.raises(ValueError, match=message):
        make_env_factory("prompt_reward", options)


def test_columns_named_as_trls_arguments_clash(rewards):
    env = PromptRewardEnv(reward_fn="trl_rewards:keyword_only")
    with pytest.raises(ValueError, match="column 'completions' clashes"):
        env.reset(Task("t", {"prompt": "p", "completions": "c"}))
    env.reset(Task("t", {"prompt": "p", "completion": "a reference"}))  # only per-sample calls take it
