"""Observations as chat turns under a Qwen3-style template, which renders the last assistant message
after the last user query with a think block and earlier ones without: exact ids and text with and
without ``enable_thinking: false``, the mask, the start-up check, and how the trajectory (what the
model saw and sampled) differs from the template's re-rendering of the conversation."""

from __future__ import annotations

import asyncio

import pytest
from agent_fakes import FakeEngine, ToyEnv

from saorl.agent import run_episode
from saorl.engines.base import SamplingParams
from saorl.envs.base import Task
from saorl.models.chat_turns import check_chat_turns
from saorl.models.codec import RunTokenizer, TokenizerSpec
from saorl.models.tokenizer import load_tokenizer

# Qwen3's layout, written for the shipped tokenizer (its eos, <|endoftext|>, closes the turns as
# <|im_end|> does Qwen3's): a think block in an assistant message after the last user query when it
# is the last message or has reasoning; tool messages as <tool_response> in a user turn; the
# generation prompt with the enable_thinking switch
QWEN3_STYLE = (
    "{% set ns = namespace(query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% set content = m.content %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.query and (loop.last or reasoning) %}"
    "<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{{ content }}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{{ eos_token }}\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
EMPTY_THINK = "<think>\n\n</think>\n\n"
TASK = Task("t-7", {"q": 7})


class SystemToy(ToyEnv):
    def __init__(self, role: str, **kw) -> None:
        super().__init__(obs="<out>{k}</out>", **kw)
        self.observation_format, self.observation_role = "chat", role

    def reset(self, task, progress=None):
        return [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Q7:"}]


def qwen3(**kwargs) -> RunTokenizer:
    hf = load_tokenizer()
    hf.chat_template = QWEN3_STYLE
    return RunTokenizer(hf, TokenizerSpec(None, True, kwargs))


def enc(tok, s):
    return tok.hf.encode(s, add_special_tokens=False)


def play(tok, actions, role="tool"):
    env = SystemToy(role, done_after=len(actions))
    engine = FakeEngine(actions)
    traj = asyncio.run(run_episode(engine, env, TASK, tok, sampling=SamplingParams(max_new_tokens=64),
                                   max_total_tokens=1024))
    traj.validate()
    return traj, env, engine


def rerender(tok, env, role):
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Q7:"}]
    for action, observation in zip(env.actions, env.observations, strict=True):
        messages += [{"role": "assistant", "content": action}, {"role": role, "content": observation}]
    return tok.hf.apply_chat_template(messages[:-1], tokenize=False, **tok.spec.chat_template_kwargs)


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {}], ids=["no-thinking", "thinking"])
@pytest.mark.parametrize("role", ["tool", "user"])
def test_the_start_up_check_accepts_a_qwen3_style_template(kwargs, role):
    check_chat_turns(qwen3(**kwargs), role)


def test_three_turns_with_thinking_off_keep_every_empty_think_block_the_model_saw():
    tok = qwen3(enable_thinking=False)
    eos = tok.eos_token_id
    a1 = enc(tok, "<tool>12+30</tool>")  # ends on a stop string: the whole closing follows
    a2 = [*enc(tok, "<tool>42*2</tool>"), eos]  # ends on eos, which closes the turn
    a3 = [*enc(tok, "<answer>84</answer>"), eos]
    traj, env, engine = play(tok, [a1, a2, a3])

    head = "<|im_start|>system\nUse the tool.<|endoftext|>\n<|im_start|>user\nQ7:<|endoftext|>\n"
    prompt = enc(tok, head + "<|im_start|>assistant\n" + EMPTY_THINK)
    obs1 = "<|endoftext|>\n<|im_start|>user\n<tool_response>\n<out>1</out>\n</tool_response><|endoftext|>\n" \
           "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    obs2 = "\n<|im_start|>user\n<tool_response>\n<out>2</out>\n</tool_response><|endoftext|>\n" \
           "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # after the sampled eos: no second one
    assert traj.token_ids == prompt + a1 + enc(tok, obs1) + a2 + enc(tok, obs2) + a3
    assert [c.prompt for c in engine.calls] == [
        prompt, prompt + a1 + enc(tok, obs1), prompt + a1 + enc(tok, obs1) + a2 + enc(tok, obs2)]
    assert env.actions == ["<tool>12+30</tool>", "<tool>42*2</tool>", "<answer>84</answer>"]

    # the mask: the model's ids (eos included) are actions; the template's turns are context
    n1 = len(prompt) + len(a1)
    n2 = n1 + len(enc(tok, obs1)) + len(a2)
    assert traj.action_mask == [0] * len(prompt) + [1] * len(a1) + [0] * len(enc(tok, obs1)) + \
        [1] * len(a2) + [0] * len(enc(tok, obs2)) + [1] * len(a3)
    assert tok.text(traj.token_ids[n1:n1 + len(enc(tok, obs1))]) == obs1
    assert tok.text(traj.token_ids[n2:n2 + len(enc(tok, obs2))]) == obs2

    # every turn's empty think block stays, as the model was prompted with it; the template's
    # re-rendering of the conversation writes only the last one
    text = tok.text(traj.token_ids)
    assert text.count(EMPTY_THINK) == 3
    assert rerender(tok, env, "tool") == text.replace(EMPTY_THINK, "", 2) + "\n"


@pytest.mark.parametrize("role", ["tool", "user"])
def test_three_turns_in_thinking_mode_keep_the_reasoning_the_model_sampled(role):
    tok = qwen3()  # enable_thinking unset: the generation prompt is the bare header
    eos = tok.eos_token_id
    a1 = enc(tok, "<think>\nadd them\n</think>\n\n<tool>12+30</tool>")
    a2 = [*enc(tok, "<think>\n\n</think>\n\n<tool>42*2</tool>"), eos]
    a3 = [*enc(tok, "<think>\ndone\n</think>\n\n<answer>84</answer>"), eos]
    traj, env, _ = play(tok, [a1, a2, a3], role)

    def turn(k):
        return (f"<|im_start|>user\n<tool_response>\n<out>{k}</out>\n</tool_response>" if role == "tool"
                else f"<|im_start|>user\n<out>{k}</out>") + "<|endoftext|>\n<|im_start|>assistant\n"

    prompt = enc(tok, "<|im_start|>system\nUse the tool.<|endoftext|>\n<|im_start|>user\nQ7:<|endoftext|>\n"
                      "<|im_start|>assistant\n")
    obs1, obs2 = enc(tok, "<|endoftext|>\n" + turn(1)), enc(tok, "\n" + turn(2))
    assert traj.token_ids == prompt + a1 + obs1 + a2 + obs2 + a3
    assert traj.action_mask == [0] * len(prompt) + [1] * len(a1) + [0] * len(obs1) + [1] * len(a2) + \
        [0] * len(obs2) + [1] * len(a3)

    # the re-rendering drops the empty think block of the second turn (after the last query, no
    # reasoning, not last) and, when each observation is a user query, the reasoning of the first
    text = tok.text(traj.token_ids)
    dropped = text.replace("<think>\n\n</think>\n\n<tool>42*2", "<tool>42*2")
    if role == "user":
        dropped = dropped.replace("<think>\nadd them\n</think>\n\n", "")
    assert rerender(tok, env, role) == dropped + "\n"
    assert dropped != text
