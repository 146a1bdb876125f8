"""env.overlong_prompts=truncate: a prompt over the budget is cut keeping its end, in its content,
then rendered again — the chat template's tokens whole, the ids exactly the cut prompt's; chat
messages lose their earliest non-system content first; a start-up line counts the cut prompts."""

import asyncio
import json
import time

import pytest

from saorl.agent.loop import PromptTooLongError, run_episode
from saorl.agent.prompt_cut import can_cut, cut_prompt, fitted_prompt_ids
from saorl.agent.scripted import ScriptedEngine
from saorl.config import load_config
from saorl.data.task import Task
from saorl.engines.base import SamplingParams
from saorl.envs.prompt_reward import PromptRewardEnv
from saorl.envs.registry import make_env_factory
from saorl.models.codec import RunTokenizer, TokenizerSpec, run_tokenizer
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.parts import build_tasks
from saorl.stages.evaluate import eval_tasks

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LONG = " ".join(f"w{i}" for i in range(300)) + " Question: what is 2+3?"


@pytest.fixture(scope="module")
def plain():
    return RunTokenizer(load_tokenizer())


@pytest.fixture(scope="module")
def chat():
    hf = load_tokenizer()
    hf.chat_template = CHATML
    return RunTokenizer(hf, TokenizerSpec(None, True, {}))


def test_a_text_prompt_keeps_its_end_and_is_the_cut_texts_rendering(plain):
    assert len(plain.prompt_ids(LONG)) > 1000
    kept, ids = cut_prompt(plain, LONG, 40)
    assert LONG.endswith(kept) and kept.endswith("w298 w299 Question: what is 2+3?")
    assert ids == plain.prompt_ids(kept)
    assert 36 <= len(ids) <= 40  # the longest end that fits, to a word's tokens
    assert fitted_prompt_ids(plain, LONG, 40) == ids
    assert fitted_prompt_ids(plain, "What is 2+3?", 40) == plain.prompt_ids("What is 2+3?")  # fits: as it is


def test_the_chat_templates_header_and_generation_prompt_survive_the_cut(chat):
    kept, ids = cut_prompt(chat, LONG, 60)
    text = chat.text(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith(
        " Question: what is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert text == f"<|im_start|>user\n{kept}<|im_end|>\n<|im_start|>assistant\n"
    assert ids == chat.prompt_ids(kept) and len(ids) <= 60
    # the template's own tokens, with nothing of the text, are over: it cannot be cut to fit
    assert len(chat.prompt_ids("")) > 5 and cut_prompt(chat, LONG, 5) is None


def test_messages_lose_their_earliest_non_system_content_first(chat):
    system = {"role": "system", "content": "Be brief."}
    msgs = [system, {"role": "user", "content": "A " * 100}, {"role": "assistant", "content": "B " * 100},
            {"role": "user", "content": "C " * 30 + "question?"}]
    # the first round (user A, assistant B) goes whole: the cut would have to pass user A's content
    kept, ids = cut_prompt(chat, msgs, 120)
    assert kept == [system, msgs[3]] and ids == chat.prompt_ids(kept)
    # tighter: the last user message's content is cut at its start; the system message stays whole
    kept, ids = cut_prompt(chat, msgs, 80)
    assert kept[0] == system and [m["role"] for m in kept] == ["system", "user"]
    assert msgs[3]["content"].endswith(kept[1]["content"]) and kept[1]["content"].endswith("question?")
    assert ids == chat.prompt_ids(kept) and 75 <= len(ids) <= 80
    assert chat.text(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    # roomy enough for user A's end: nothing is dropped, user A is cut, the rest whole
    whole = len(chat.prompt_ids(msgs))
    kept, ids = cut_prompt(chat, msgs, whole - 20)
    assert kept[2:] == msgs[2:] and msgs[1]["content"].endswith(kept[1]["content"])
    assert 0 < len(kept[1]["content"]) < len(msgs[1]["content"]) and len(ids) <= whole - 20
    # the system message alone is over: None
    assert cut_prompt(chat, [{"role": "system", "content": "S " * 200}, msgs[3]], 60) is None
    # can_cut, from the uncuttable part alone, agrees with cut_prompt at every limit
    for limit in range(20, whole + 2, 3):
        for prompt in (msgs, msgs[1:], [msgs[0], msgs[3]], LONG):
            assert can_cut(chat, prompt, limit) == (cut_prompt(chat, prompt, limit) is not None), limit


def test_a_huge_prompt_is_cut_without_tokenising_it_whole(plain):
    huge = "x" * 20_000_000 + " So, the end?"
    t0 = time.perf_counter()
    ids = fitted_prompt_ids(plain, huge, 50)
    assert time.perf_counter() - t0 < 5.0  # tokenising 20 MB takes minutes
    assert len(ids) <= 50 and plain.text(ids).endswith("xxx So, the end?")


def _cfg(tmp_path, rows, mode="truncate", total=128, new=32):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, ["env.type=prompt_reward", f"env.tasks_file={path}", "env.num_test_tasks=2",
                              "env.num_train_tasks=100",
                              "env.options.reward_fn=saorl.envs.rewards:number_answer",
                              "env.call_timeout_s=null", f"env.overlong_prompts={mode}",
                              f"rollout.max_total_tokens={total}", f"rollout.max_new_tokens={new}"])


def test_truncate_keeps_the_tasks_with_one_line_and_the_episode_plays_the_cut_prompt(tmp_path, capsys):
    rows = ([{"id": f"r{i}", "prompt": f"What is {i}+1?", "answer": i + 1} for i in range(8)]
            + [{"id": "long", "prompt": LONG, "answer": 5}])
    cfg = _cfg(tmp_path, rows)
    tokenizer = run_tokenizer(cfg.model)
    train, test = build_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options), tokenizer)
    tasks = {t.id: t for t in train + test}
    assert len(tasks) == 9 and {t.prompt_limit for t in tasks.values()} == {96}
    out = capsys.readouterr().out
    assert "1 cut to fit, keeping their end (env.overlong_prompts=truncate)" in out
    assert "long (1104 tokens)" in out and "over 96 tokens" in out

    env = PromptRewardEnv(reward_fn="saorl.envs.rewards:number_answer")
    traj = asyncio.run(run_episode(ScriptedEngine(tokenizer, ["It is 5."]), env, tasks["long"], tokenizer,
                                   sampling=SamplingParams(max_new_tokens=32), max_total_tokens=128))
    prompt = traj.token_ids[:traj.prompt_len]
    assert traj.prompt_len <= 96 and prompt == cut_prompt(tokenizer, LONG, 96)[1]
    assert tokenizer.text(prompt).endswith("w299 Question: what is 2+3?")
    assert traj.episode.final_reward == 1.0
    short = asyncio.run(run_episode(ScriptedEngine(tokenizer, ["2"]), env, tasks["r1"], tokenizer,
                                    sampling=SamplingParams(max_new_tokens=32), max_total_tokens=128))
    assert short.token_ids[:short.prompt_len] == tokenizer.prompt_ids("What is 1+1?")


def test_an_uncuttable_prompt_is_left_out_named_and_fails_an_episode_clearly(tmp_path, capsys, chat):
    system = {"role": "system", "content": "S " * 200}
    rows = ([{"id": f"r{i}", "prompt": [{"role": "user", "content": f"What is {i}+1?"}], "answer": i + 1}
             for i in range(6)] + [{"id": "sys", "prompt": [system, {"role": "user", "content": "hi"}],
                                    "answer": 1}])
    cfg = _cfg(tmp_path, rows)
    train, test = build_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options), chat)
    assert "sys" not in {t.id for t in train + test} and len(train + test) == 6
    out = capsys.readouterr().out
    assert "0 cut to fit" in out and "1 cannot be cut to fit (the chat template and system messages alone " \
        "are over), left out: sys" in out
    env = PromptRewardEnv(reward_fn="saorl.envs.rewards:number_answer")
    task = Task("sys", rows[-1], prompt_limit=96)
    with pytest.raises(PromptTooLongError, match=r"task 'sys': the prompt cannot be cut to 96 tokens"):
        asyncio.run(run_episode(ScriptedEngine(chat, ["1"]), env, task, chat,
                                sampling=SamplingParams(max_new_tokens=32), max_total_tokens=128))


def test_eval_cuts_alike(tmp_path, capsys):
    rows = [{"id": f"r{i}", "prompt": LONG if i % 2 else f"What is {i}+1?", "answer": 5} for i in range(8)]
    cfg = _cfg(tmp_path, rows)
    tasks = eval_tasks(cfg, make_env_factory(cfg.env.type, cfg.env.options), "test", 2,
                       run_tokenizer(cfg.model))
    assert len(tasks) == 2 and all(t.prompt_limit == 96 for t in tasks)
    assert "cut to fit, keeping their end (env.overlong_prompts=truncate)" in capsys.readouterr().err


def test_saorl_eval_cuts_and_says_so(tmp_path, capsys):
    """The command line, end to end: ``saorl eval`` with truncate plays the long prompt, cut."""
    from saorl.cli import main

    rows = [{"id": f"r{i}", "prompt": LONG if i == 7 else f"What is {i}+1?", "answer": 5} for i in range(8)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "tiny-moe", "env.type=prompt_reward", f"env.tasks_file={path}", "env.num_test_tasks=2",
            "env.options.reward_fn=saorl.envs.rewards:number_answer", "env.call_timeout_s=null",
            "env.overlong_prompts=truncate", "rollout.max_total_tokens=128", "rollout.max_new_tokens=32",
            "--tasks", "2", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "prompts: 1 of 2 test tasks have prompts over 96 tokens" in err
    assert "1 cut to fit, keeping their end (env.overlong_prompts=truncate)" in err
    assert json.loads(out)["eval/episodes"] == 2  # stdout stays JSON
