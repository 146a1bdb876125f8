"""``bfcl``: BFCL v4 multi_turn_base against the real bfcl-eval (installed --no-deps by the fixture):
the possible answers succeed by BFCL's own checker, wrong play fails, bad calls are observations."""

from __future__ import annotations

import asyncio
import json
import random
import sys

import pytest

from saorl.data.task import Task
from saorl.envs.demo import play_demonstration

pytestmark = pytest.mark.usefixtures("bfcl")

FS_TASK = Task("multi_turn_base_0", {"category": "multi_turn_base", "id": "multi_turn_base_0"})
"""Move final_report.pdf into a new temp directory, grep it, sort it, diff it (file system + posts)."""


def env(**options):
    from saorl.envs.bfcl_env import BfclEnv

    return BfclEnv(prompt="text", **options)


def bfcl_tasks():
    from saorl.envs import bfcl_data

    return [(i, e["involved_classes"]) for i, e in bfcl_data.entries("multi_turn_base").items()]


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def finish(e, first):
    """Step ``first`` (an action), then end every request with a reply without a call."""
    out = e.step(first)
    while not out.done:
        out = e.step("Done.")
    return out


@pytest.mark.parametrize("task_id", ["multi_turn_base_0", "multi_turn_base_173", "multi_turn_base_199"])
def test_the_possible_answer_succeeds_by_bfcls_checker(task_id):
    task = Task(task_id, {"category": "multi_turn_base", "id": task_id})
    ep = play_demonstration(env(), task, random.Random(0))
    assert ep.done and ep.success and ep.reward == 1.0
    assert ep.info["error_type"] == ""
    metrics = ep.info["metrics"]
    assert metrics["tool_errors"] == 0 and metrics["tool_calls"] > 0 and metrics["force_quit"] == 0
    assert metrics["requests"] == sum(1 for a, _ in ep.turns if a == "Done.")
    # the backends answered: the first call's result is a backend's JSON, not an error
    assert "<tool_response>\n{" in ep.turns[0][1]


def test_a_wrong_episode_fails():
    e = env()
    e.reset(FS_TASK)
    # the wrong directory name: the state after the first request differs from the ground truth's
    out = e.step(call("cd", folder="document") + call("mkdir", dir_name="tmp") +
                 call("mv", source="final_report.pdf", destination="tmp"))
    assert "error" not in out.observation
    out = finish(e, "Done.")
    assert out.reward == 0.0 and out.info["success"] is False
    assert out.info["error_type"] == "multi_turn:instance_state_mismatch"
    e = env()
    e.reset(FS_TASK)
    out = finish(e, "I will not do that.")  # no calls at all
    assert out.reward == 0.0 and out.info["error_type"] == "multi_turn:empty_turn_model_response"
    assert out.info["metrics"]["tool_calls"] == 0 and out.info["metrics"]["requests"] == 4


def test_bad_calls_are_observations_and_counted():
    e = env()
    prompt = e.reset(FS_TASK)
    assert '"name": "mkdir"' in prompt and "Move 'final_report.pdf'" in prompt
    out = e.step('<tool_call>{"name": "cd", "arguments": {"folder": </tool_call>' + call("no_such_fn") +
                 call("cd", directory="document") + call("cd") + call("cd", folder="document"))
    texts = out.observation.split("</tool_response>")
    assert "error: unknown function 'no_such_fn'; the functions are: authenticate_twitter, " in texts[0]
    assert " cat, cd, cp, " in texts[0]
    assert "error: bad arguments for cd: unexpected argument 'directory' (it takes: folder)" in texts[1]
    assert "Error during execution: " in texts[2] and "folder" in texts[2]  # the backend's own answer
    assert '{"current_working_directory": "document"}' in texts[3]
    assert "error: malformed tool call: <tool_call> 1: not JSON" in texts[4]
    assert out.done is False
    out = finish(e, "Done.")
    assert out.info["metrics"]["tool_calls"] == 5 and out.info["metrics"]["tool_errors"] == 4


def test_hostile_calls_run_nothing(tmp_path):
    marker = tmp_path / "pwned"
    shell = f"__import__('os').system('touch {marker}')"
    e = env()
    e.reset(FS_TASK)
    out = e.step(call(shell) + call("cd", **{f"folder={shell},x": "document"}) +
                 call("touch", file_name="notes.txt") + call("echo", content=shell, file_name="notes.txt") +
                 call("cat", file_name="notes.txt") +
                 call("cd", folder=f"'){shell}#"))
    texts = out.observation.split("</tool_response>")
    assert texts[0].strip().startswith("<tool_response>\nerror: unknown function")
    assert "error: bad arguments for cd: unexpected argument" in texts[1]
    assert shell in texts[4]  # written to the file and read back as the text it is
    assert not marker.exists()
    out = e.step('<tool_call>{"name": "cd", "arguments": {"folder": NaN}}</tool_call>')
    assert "non-finite" in out.observation
    math_task = next(t for t in bfcl_tasks() if "MathAPI" in t[1])[0]
    e = env()
    e.reset(Task(math_task, {"id": math_task}))
    out = e.step(call("power", base=10, exponent=10**9) +
                 call("logarithm", value=2, base=10, precision=10**9))
    assert out.observation.count("above 1000 in magnitude is refused") == 2
    assert not marker.exists()


def test_the_step_cap_per_request_force_quits():
    e = env(steps_per_turn=2)
    e.reset(FS_TASK)
    for _ in range(2):
        assert not e.step(call("pwd")).done
    out = e.step(call("pwd"))
    assert out.done and out.reward == 0.0 and out.info["error_type"] == "multi_turn:force_terminated"
    assert out.info["metrics"]["force_quit"] == 1.0


def test_the_split_is_disjoint_stable_and_seeded():
    from saorl.envs import bfcl_data

    split = bfcl_data.split_ids("multi_turn_base")
    assert len(split["train"]) == 160 and len(split["test"]) == 40
    assert not set(split["train"]) & set(split["test"])
    # the held-out ids (docs/envs.md lists them)
    pinned = [1, 4, 7, 8, 17, 18, 32, 34, 37, 40, 41, 44, 45, 47, 50, 58, 62, 65, 66, 82, 85, 89, 90, 91, 92,
              93, 99, 112, 127, 129, 139, 140, 144, 161, 168, 184, 185, 190, 194, 198]
    assert split["test"] == [f"multi_turn_base_{k}" for k in pinned]  # the held-out set must never move
    e = env()
    test = e.generate_tasks("test", 100, seed=3)
    assert sorted(t.id for t in test) == sorted(split["test"])  # at most the 40
    assert [t.id for t in e.generate_tasks("test", 5, seed=3)] == [t.id for t in test[:5]]
    assert [t.id for t in e.generate_tasks("test", 5, seed=4)] != [t.id for t in test[:5]]
    train = e.generate_tasks("train", 400, seed=0)
    assert len(train) == 400 and {t.id for t in train} == set(split["train"])  # epochs over the 160


def test_bad_options_and_a_missing_package_are_named(monkeypatch):
    from saorl.envs.registry import MissingExtra, make_env_factory, resolve_env

    with pytest.raises(ValueError, match=r"category 'multi_turn_miss_func' is not played \(yet\)"):
        make_env_factory("bfcl", {"category": "multi_turn_miss_func"})
    with pytest.raises(ValueError, match="steps_per_turn must be an integer >= 1"):
        make_env_factory("bfcl", {"steps_per_turn": 0})
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)
    with pytest.raises(MissingExtra, match=r"needs the package bfcl-eval==2026\.3\.23, .*: pip install "
                                           r"--no-deps bfcl-eval==2026\.3\.23, then run again"):
        resolve_env("bfcl")


def test_an_episode_through_the_agent_loop_is_token_exact():
    """The possible answer played by the scripted engine, chat turns through a ChatML template: the
    trajectory's ids decode to the conversation, only the replies are actions, and it succeeds."""
    from saorl.agent import demonstration_trajectory
    from saorl.envs.bfcl_env import BfclEnv
    from saorl.models.codec import RunTokenizer
    from saorl.models.tokenizer import load_tokenizer

    hf = load_tokenizer()
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = RunTokenizer(hf)
    e = BfclEnv()
    task = Task("multi_turn_base_12", {"category": "multi_turn_base", "id": "multi_turn_base_12"})
    traj = asyncio.run(demonstration_trajectory(e, task, tok, random.Random(0), max_total_tokens=20000))
    assert traj.episode.success and traj.episode.final_reward == 1.0 and not traj.truncated
    actions = BfclEnv().demonstration(task, random.Random(0))
    acted = hf.decode([t for t, m in zip(traj.token_ids, traj.action_mask) if m])
    assert acted == "".join(a + hf.eos_token for a in actions)
    text = hf.decode(traj.token_ids)
    assert "<|im_end|>\n<|im_start|>user\n<tool_response>\n" in text
    second = BfclEnv().reset(task)[1]["content"]
    assert hf.decode(hf(second, add_special_tokens=False)["input_ids"]) in text
