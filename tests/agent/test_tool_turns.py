"""Native tool calls in an episode (env.tools): the schemas in the prompt, the calls run and their
results added as tool messages through the template, token-exact with the right action mask, the
errors the model reads (and counts), a hanging tool killed by the deadline, the reward functions
given the whole conversation."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import tool_fns
import torch

from saorl.agent import ScriptedEngine, run_episode
from saorl.algo.gae import skip_observation_gae
from saorl.engines.base import SamplingParams
from saorl.envs.base import Task
from saorl.envs.registry import make_env_factory
from saorl.envs.toolbox import ToolBox, ToolOptions
from saorl.models.codec import RunTokenizer
from saorl.models.tokenizer import load_tokenizer

QWEN = (  # Qwen2.5's layout, shortened: tools in the system message, a tool message as <tool_response>
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# <tool_call> #}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TASK = Task("t-1", {"prompt": [{"role": "user", "content": "What is 2+3?"}]})


def codec(template: str) -> RunTokenizer:
    hf = load_tokenizer()
    hf.chat_template = template
    return RunTokenizer(hf)


def factory(*specs: str, timeout: float | None = None, **opts):
    return make_env_factory("prompt_reward", {"reward_fn": "tool_fns:reward"}, call_timeout_s=timeout,
                            tool_options=ToolOptions(tuple(f"tool_fns:{s}" for s in specs), **opts))


def play(tok, env, actions, max_total_tokens=1024):
    engine = ScriptedEngine(tok.hf, actions)
    traj = asyncio.run(run_episode(engine, env, TASK, tok, sampling=SamplingParams(max_new_tokens=256),
                                   max_total_tokens=max_total_tokens))
    traj.validate()
    return traj, engine


def test_a_tool_calling_episode_is_token_exact_with_the_result_as_a_tool_message():
    tok = codec(QWEN)
    with factory("add") as make:
        env = make()
        assert env.observation_format == "chat" and env.observation_role == "tool" and env.max_turns == 4
        traj, engine = play(tok, env, [CALL, "The answer is 5."])
    hf, eos = tok.hf, tok.eos_token_id
    props = {"a": {"type": "integer", "description": "The first number."},
             "b": {"type": "integer", "description": "The second number."}}
    schema = {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": props, "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    prompt = hf.apply_chat_template(TASK.data["prompt"], tools=[schema], tokenize=False,
                                    add_generation_prompt=True)
    assert '"name": "add"' in prompt and prompt.startswith("<|im_start|>system\nTOOLS:")
    p_ids = hf.encode(prompt, add_special_tokens=False)
    a1 = [*hf.encode(CALL, add_special_tokens=False), eos]
    a2 = [*hf.encode("The answer is 5.", add_special_tokens=False), eos]
    obs = hf.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n", add_special_tokens=False)  # eos is not the template's closing
    assert traj.token_ids == p_ids + a1 + obs + a2
    assert engine.requests == [p_ids, p_ids + a1 + obs]
    assert traj.action_mask == [0] * len(p_ids) + [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
    assert traj.rewards[-1] == 1.0 and sum(traj.rewards) == 1.0
    ep = traj.episode
    assert ep.turns == 2 and ep.success and ep.truncation is None
    assert ep.env_metrics == {"reward/reward": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
    # the reward function got TRL's completion: the calling turn, the tool's result, the final reply
    assert tool_fns.reward.seen == [[
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."}]]
    # skip-observation GAE jumps the tool result: values there (NaN) are never read
    mask = torch.tensor([traj.action_mask])
    values = torch.where(mask.bool(), torch.rand(mask.shape), torch.tensor(float("nan")))
    adv, _ = skip_observation_gae(torch.tensor([traj.rewards]), values, mask, 1.0, 1.0)
    assert torch.isfinite(adv).all() and (adv[~mask.bool()] == 0).all()


def test_a_template_without_tools_gets_them_in_the_system_message():
    tok = codec(CHATML)
    with factory("add") as make:
        traj, engine = play(tok, make(), [CALL, "5"])
    text = tok.hf.decode(engine.requests[0])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    tail = "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert tok.hf.decode(engine.requests[1]).endswith(tail)
    assert traj.episode.success
    with factory("add", prompt="list") as make:
        _, engine = play(tok, make(), ["5"])
    text = tok.hf.decode(engine.requests[0])
    assert "- add(a: integer, b: integer): Add two integers." in text
    assert 'To call one, write <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>' in text


def test_errors_are_tool_messages_the_model_reads_and_are_counted():
    tok = codec(QWEN)
    bad = ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'  # not JSON
           '<tool_call>{"name": "sub", "arguments": {}}</tool_call>'          # unknown
           '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 1}}</tool_call>'  # schema mismatch
           '<tool_call>{"name": "explode", "arguments": {"x": 7}}</tool_call>')      # raises
    with factory("add", "explode") as make:
        traj, engine = play(tok, make(), [bad, "The answer is 5."])
    seen = tool_fns.reward.seen[0]
    results = [m["content"] for m in seen if m["role"] == "tool"]
    assert results == ["error: unknown tool 'sub'; the tools are: add, explode",
                       "error: bad arguments for add: argument 'a' must be integer, got \"x\"",
                       "error: explode raised RuntimeError: boom 7",
                       results[3]]
    assert results[3].startswith("error: malformed tool call: <tool_call> 1: not JSON")
    context = tok.hf.decode(engine.requests[1])
    assert all(f"<tool_response>\n{r}\n</tool_response>" in context for r in results)
    assert traj.episode.env_metrics["tool_calls"] == 4 and traj.episode.env_metrics["tool_errors"] == 4
    assert not traj.episode.success  # no tool said 5


def test_binding_errors_are_results_too():
    box = ToolBox(["tool_fns:add"])
    assert box.call("add", {"a": 1, "c": 2}).error
    assert box.call("add", {"a": 1, "c": 2}).text == "error: bad arguments for add: missing a required " \
                                                     "argument: 'b'"
    assert box.call("add", {"a": 1, "b": 2}).text == "3" and not box.call("add", {"a": 1, "b": 2}).error


def test_the_last_turn_is_scored_as_it_is_and_tool_stop_ends_a_turn_at_the_call():
    tok = codec(QWEN)
    with factory("add", max_turns=2, stop=True) as make:
        env = make()
        traj, _ = play(tok, env, [CALL, CALL])
    assert traj.episode.turns == 2 and traj.episode.truncation is None and not traj.episode.success
    assert tool_fns.reward.seen[0][-1] == {"role": "assistant", "content": CALL}
    assert traj.episode.env_metrics["tool_calls"] == 1  # the second call was the final reply, not run


def test_a_hanging_tool_is_killed_by_the_deadline_and_read_as_an_error():
    tok = codec(QWEN)
    call = '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
    with factory("add", "hang", timeout=1.5) as make:
        traj, engine = play(tok, make(), [call, CALL, "The answer is 5."])
        pids = make.tools.pool.pids()
    # the reward function ran in a child too (prompt_reward's calls are user code): read the context
    context = tok.hf.decode(engine.requests[2])
    assert context.count("<tool_response>") == 2
    killed = "error: hang did not return within 1.5 s and was stopped"
    assert f"<tool_response>\n{killed}\n</tool_response>" in context
    assert context.endswith("<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.episode.env_metrics["tool_errors"] == 1 and traj.episode.success
    assert len(pids) == 1  # the killed child was replaced by one that ran add


def test_a_turn_runs_at_most_tool_max_calls_calls_and_none_after_a_deadline():
    tok = codec(QWEN)
    with factory("add", max_calls=2) as make:
        traj, _ = play(tok, make(), [CALL * 3, "The answer is 5."])
    results = [m["content"] for m in tool_fns.reward.seen[0] if m["role"] == "tool"]
    assert results == ["5", "5", "error: not run (a turn runs at most 2 tool calls; make the others in "
                                 "a later turn)"]
    assert traj.episode.env_metrics["tool_calls"] == 3 and traj.episode.env_metrics["tool_errors"] == 1
    hang = '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
    with factory("add", "hang", timeout=0.5) as make:
        traj, engine = play(tok, make(), [CALL + hang * 3 + CALL, "The answer is 5."])
    # the reward function ran in a child (call_timeout_s): read the results off the context
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", tok.hf.decode(engine.requests[1]))
    late = "error: not run (an earlier call of this turn ran past its deadline)"
    # one deadline, then the turn's other calls are answered without running
    assert results == ["5", "error: hang did not return within 0.5 s and was stopped"] + [late] * 3
    assert traj.episode.env_metrics["tool_errors"] == 4


def test_bad_tools_are_refused_at_start_naming_them():
    from saorl.config import load_config
    from saorl.errors import StartupError
    from saorl.stages.env_check import check_env

    base = ["env.type=prompt_reward", "env.options.reward_fn=tool_fns:reward"]
    with pytest.raises(StartupError) as e:
        check_env(load_config(None, [*base, "env.tools=[tool_fns:nodoc]"]))
    assert str(e.value).startswith("env.tools: tool tool_fns:nodoc cannot be offered to the model")
    with pytest.raises(StartupError, match=r"env.tools: tool 'tool_fns:nope': module 'tool_fns' has no"):
        check_env(load_config(None, [*base, "env.tools=[tool_fns:nope]"]))
    assert json.dumps(check_env(load_config(None, [*base, "env.tools=[tool_fns:add]"])).template.tools) == \
        '["tool_fns:add"]'


def test_a_demonstration_with_a_tool_call_plays_through_the_tools():
    """prompt_reward's demo column as a list of actions: the call, then the answer (SFT's trajectory)."""
    import random

    from saorl.agent import demonstration_trajectory

    tok = codec(QWEN)
    task = Task("t-2", {**TASK.data, "demo": [CALL, "The answer is 5."]})
    make = make_env_factory("prompt_reward", {"reward_fn": "tool_fns:reward", "demo_column": "demo"},
                            tool_options=ToolOptions(("tool_fns:add",), stop=True))
    with make:
        traj = asyncio.run(demonstration_trajectory(make(), task, tok, random.Random(0)))
    assert traj.episode.turns == 2 and traj.episode.success
    assert traj.episode.env_metrics["tool_calls"] == 1
    text = tok.hf.decode(traj.token_ids)
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>" in text
    acted = tok.hf.decode([t for t, m in zip(traj.token_ids, traj.action_mask) if m])
    assert acted == CALL + "The answer is 5." + tok.hf.eos_token  # the call ended on its stop string


def test_the_prompt_budget_counts_the_tools_schemas():
    from saorl.agent.prompts import screen_prompts

    tok = codec(CHATML)
    plain = len(tok.prompt_ids(TASK.data["prompt"]))
    with factory("add") as make:
        env = make()
        from saorl.agent.tool_turns import with_tools

        with_schemas = len(tok.prompt_ids(with_tools(env, tok, TASK.data["prompt"])[1]))
        assert with_schemas > plain + 50
        assert screen_prompts([TASK], make, tok, with_schemas).kept == [TASK]
        screened = screen_prompts([TASK], make, tok, with_schemas - 1)
    assert screened.kept == [] and screened.overlong == [(TASK, with_schemas)]
