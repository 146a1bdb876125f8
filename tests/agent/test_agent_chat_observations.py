"""Observations as chat turns (env.observation_format=chat): exact ids and text, masks, the eos
that closes a turn, both tokenizer families, and the templates that cannot add a turn (Qwen3-style
think blocks: test_agent_chat_thinking.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from agent_fakes import FakeEngine, ToyEnv

from saorl.agent import EpisodeError, run_episode
from saorl.engines.base import SamplingParams
from saorl.envs.base import Task
from saorl.models.chat_turns import TemplateSplitError, check_chat_turns
from saorl.models.codec import RunTokenizer, without_prefix_space
from saorl.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from model_families import sp_tokenizer

TASK = Task("t-7", {"q": 7})
SP = SamplingParams(max_new_tokens=64)
QWEN_TOOLS = (  # Qwen's layout: a tool message is a <tool_response> inside a user turn
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response>{{ eos_token }}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SP_TOOLS = (  # Llama-2-like: BOS, bracketed turns, the assistant's message closed by eos
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% else %}[{{ m.role | upper }}] {{ m.content }} [/{{ m.role | upper }}]{% endif %}{% endfor %}")


def shipped_with(template: str) -> RunTokenizer:
    hf = load_tokenizer()
    hf.chat_template = template
    return RunTokenizer(hf)


def enc(tok, s):
    return tok.hf.encode(s, add_special_tokens=False)


def chat_env(role: str = "tool", **kw) -> ToyEnv:
    env = ToyEnv(**kw)
    env.observation_format, env.observation_role = "chat", role
    return env


def play(engine, env, tok):
    return asyncio.run(run_episode(engine, env, TASK, tok, sampling=SP, max_total_tokens=1024))


def render(tok, messages, generation_prompt):
    return tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_three_turns_with_tool_messages_through_the_shipped_tokenizer():
    tok = shipped_with(QWEN_TOOLS)
    eos = tok.eos_token_id
    a1 = [i for ch in "hello world</a>" for i in enc(tok, ch)]  # one id per character: not canonical
    assert a1 != enc(tok, "hello world</a>")
    a2 = [*enc(tok, "think more"), eos]  # ends on eos, which closes the turn
    a3 = [*enc(tok, "answer 42"), eos]
    engine = FakeEngine([a1, a2, a3])
    env = chat_env(done_after=3)
    traj = play(engine, env, tok)
    traj.validate()

    prompt = enc(tok, "<|im_start|>user\nQ7:<|endoftext|>\n<|im_start|>assistant\n")
    obs1 = enc(tok, "<|endoftext|>\n<|im_start|>user\n<tool_response>\n<obs 1>\n\n</tool_response>"
                    "<|endoftext|>\n<|im_start|>assistant\n")  # closing added: a1 ended on a stop string
    obs2 = enc(tok, "\n<|im_start|>user\n<tool_response>\n<obs 2>\n\n</tool_response><|endoftext|>\n"
                    "<|im_start|>assistant\n")  # the sampled eos closed the turn: no second one
    assert traj.token_ids == prompt + a1 + obs1 + a2 + obs2 + a3
    assert env.actions == ["hello world</a>", "think more", "answer 42"]
    assert [c.prompt for c in engine.calls] == [prompt, prompt + a1 + obs1, prompt + a1 + obs1 + a2 + obs2]

    conversation = [{"role": "user", "content": "Q7:"}, {"role": "assistant", "content": "hello world</a>"},
                    {"role": "tool", "content": "<obs 1>\n"}, {"role": "assistant", "content": "think more"},
                    {"role": "tool", "content": "<obs 2>\n"}]
    text = tok.text(traj.token_ids)
    assert text == render(tok, conversation, True) + "answer 42<|endoftext|>"
    assert render(tok, [*conversation, {"role": "assistant", "content": "answer 42"}], False) == text + "\n"

    # the mask: the model's own ids (eos included) are actions; the template's turns are not
    n0, n1, n2 = len(prompt), len(prompt) + len(a1) + len(obs1), len(traj) - len(a3)
    actions = [*range(n0, n0 + len(a1)), *range(n1, n1 + len(a2)), *range(n2, len(traj))]
    assert [t for t, m in enumerate(traj.action_mask) if m] == actions
    context = [t for t, m in enumerate(traj.action_mask) if not m and t >= len(prompt)]
    assert [traj.token_ids[t] for t in context] == obs1 + obs2
    assert all(traj.rollout_logprobs[t] == 0.0 and traj.versions[t] == -1 for t in context)
    assert traj.episode.final_observation == "<obs 3>\n"  # the last one is not tokenized


def test_an_eos_that_the_closing_does_not_contain_stays_and_the_whole_closing_follows():
    tok = shipped_with(QWEN_TOOLS.replace("{{ eos_token }}", "<|im_end|>"))  # eos is <|endoftext|>
    a1 = [*enc(tok, "go</a>"), tok.eos_token_id]
    traj = play(FakeEngine([a1, enc(tok, "done")]), chat_env(done_after=2), tok)
    assert tok.text(traj.token_ids).endswith(
        "assistant\ngo</a><|endoftext|><|im_end|>\n<|im_start|>user\n<tool_response>\n<obs 1>\n\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\ndone")


def test_a_user_role_and_a_conversation_prompt():
    tok = shipped_with(QWEN_TOOLS)
    eos = tok.eos_token_id

    class SystemToy(ToyEnv):
        def reset(self, task, progress=None):
            return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q7:"}]

    env = SystemToy(done_after=2)
    env.observation_format, env.observation_role = "chat", "user"
    traj = play(FakeEngine([[*enc(tok, "go</a>"), eos], enc(tok, "done")]), env, tok)
    assert tok.text(traj.token_ids) == (
        "<|im_start|>system\nBe brief.<|endoftext|>\n<|im_start|>user\nQ7:<|endoftext|>\n"
        "<|im_start|>assistant\ngo</a><|endoftext|>\n<|im_start|>user\n<obs 1>\n<|endoftext|>\n"
        "<|im_start|>assistant\ndone")


@pytest.mark.parametrize("metaspace", [False, True], ids=["sp-prepend", "sp-metaspace"])
def test_sentencepiece_turns_are_exact(metaspace):
    hf = sp_tokenizer(metaspace=metaspace)
    hf.chat_template = SP_TOOLS
    tok = RunTokenizer(hf)
    eos = tok.eos_token_id
    a1 = [*enc(tok, "hello world</a>"), eos]  # "▁hello...": the action's text is " hello world</a>"
    a2 = enc(tok, "then 42</a>")
    traj = play(FakeEngine([a1, a2]), chat_env(done_after=2), tok)
    prompt_len = traj.prompt_len
    obs = traj.token_ids[prompt_len + len(a1):len(traj) - len(a2)]
    delta = "[TOOL] <obs 1>\n [/TOOL]"  # after the sampled </s>, which closed the turn
    ctx = traj.token_ids[:prompt_len + len(a1)]
    assert tok.text(ctx + obs) == tok.text(ctx) + delta
    # the plain encoding would put the dummy prefix's space before "[TOOL]"; the exact one does not
    assert tok.text(ctx + enc(tok, delta)) == tok.text(ctx) + " " + delta
    assert obs == without_prefix_space(hf.backend_tokenizer).encode(delta, add_special_tokens=False).ids
    conversation = [{"role": "user", "content": "Q7:"}, {"role": "assistant", "content": " hello world</a>"},
                    {"role": "tool", "content": "<obs 1>\n"}]
    rendered = render(tok, conversation, True) + " then 42</a>"
    prompt_text = tok.text(traj.token_ids[:prompt_len])
    # after the prompt the decoded trajectory is the template's rendering exactly; the prompt is the
    # tokenizer's own encoding of it (with the Prepend normalizer: a space after <s>, as HF encodes it)
    assert tok.span_text(traj.token_ids, prompt_len, len(traj)) == \
        rendered[len(render(tok, conversation[:1], True)):]
    if metaspace:
        assert tok.text(traj.token_ids) == rendered
    else:
        assert prompt_text == "<s> [USER] Q7: [/USER]"
    assert [m for m in traj.action_mask[prompt_len:]] == [1] * len(a1) + [0] * len(obs) + [1] * len(a2)


def test_the_space_a_template_puts_before_the_assistants_message_is_the_models_own():
    """Mistral-style: ``[/INST]`` then a space then the message; a SentencePiece model samples that
    space itself (``▁hello``), so the history holds the message without it."""
    hf = sp_tokenizer(metaspace=True)
    hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ ' ' + m.content }}"
        "{{ eos_token }}{% else %}[INST] {{ m.content }}[/INST]{% endif %}{% endfor %}")
    tok = RunTokenizer(hf)
    check_chat_turns(tok, "user")
    a1 = [*enc(tok, "hello world</a>"), tok.eos_token_id]
    a2 = enc(tok, "then 42")
    env = chat_env("user", done_after=2)
    traj = play(FakeEngine([a1, a2]), env, tok)
    assert env.actions == [" hello world</a>", " then 42"]
    conversation = [{"role": "user", "content": "Q7:"}, {"role": "assistant", "content": "hello world</a>"},
                    {"role": "user", "content": "<obs 1>\n"}]
    assert tok.text(traj.token_ids) == render(tok, conversation, True) + " then 42" == \
        "<s>[INST] Q7:[/INST] hello world</a></s>[INST] <obs 1>\n[/INST] then 42"


def test_a_closing_that_differs_before_a_tool_message_is_the_one_appended():
    call = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.role == 'assistant' and "
            "not loop.last and messages[loop.index0 + 1].role == 'tool' %}<|call|>\n{% else %}{{ eos_token }}"
            "\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = shipped_with(call)
    for role, closing in (("tool", "<|call|>"), ("user", "<|endoftext|>")):
        check_chat_turns(tok, role)
        traj = play(FakeEngine([enc(tok, "go</a>"), enc(tok, "done")]), chat_env(role, done_after=2), tok)
        assert tok.text(traj.token_ids) == (
            f"<|im_start|>user\nQ7:<|endoftext|>\n<|im_start|>assistant\ngo</a>{closing}\n<|im_start|>{role}\n"
            "<obs 1>\n<|endoftext|>\n<|im_start|>assistant\ndone")


def test_a_template_that_drops_earlier_assistant_messages_is_named_at_the_probe_and_in_the_loop():
    last_only = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>"
                 "{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = shipped_with(last_only)
    with pytest.raises(TemplateSplitError, match=(
            r"cannot add an observation as a turn: it does not write the assistant's message once, as it is "
            r"\(a message '\w+' followed by a 'tool' message appears 0 times in its rendering\).* drops "
            r"earlier assistant messages.* set env\.observation_format=text")):
        check_chat_turns(tok, "tool")
    with pytest.raises(EpisodeError, match=r"env 'toy' task 't-7': env\.observation_format=chat: the chat "
                                           r"template cannot add an observation"):
        play(FakeEngine([enc(tok, "a</a>"), enc(tok, "b")]), chat_env(done_after=2), tok)


def test_a_template_that_closes_a_turn_by_what_it_says_is_named_at_the_probe_and_in_the_loop():
    by_content = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.role == "
                  "'assistant' and '<tool>' in m.content %}<|call|>\n{% else %}{{ eos_token }}\n{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = shipped_with(by_content)
    with pytest.raises(TemplateSplitError, match=(
            r"cannot add an observation as a turn after this action: what it writes after the assistant's "
            r"message depends on what the message says \(with the action's text its rendering reads "
            r"'.*30</tool><\|call\|>\\n<.*' where, with another text, it reads '<\|endoftext\|>\\n<.*'\).* "
            r"set env\.observation_format=text")):
        check_chat_turns(tok, "user")
    with pytest.raises(EpisodeError, match=r"env 'toy' task 't-7': .* depends on what the message says"):
        play(FakeEngine([enc(tok, "<tool>1</a>"), enc(tok, "b")]), chat_env(done_after=2), tok)
    traj = play(FakeEngine([enc(tok, "a</a>"), enc(tok, "b")]), chat_env(done_after=2), tok)
    assert tok.text(traj.token_ids).endswith(  # an action without a tool call: as the template writes it
        "a</a><|endoftext|>\n<|im_start|>tool\n<obs 1>\n<|endoftext|>\n<|im_start|>assistant\nb")


def test_a_template_that_trims_messages_keeps_the_models_own_text():
    trims = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}{{ eos_token }}\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = shipped_with(trims)
    check_chat_turns(tok, "tool")
    a1 = enc(tok, "go</a>\n")  # a trailing newline the template would trim
    traj = play(FakeEngine([a1, enc(tok, "done")]), chat_env(done_after=2), tok)
    assert tok.text(traj.token_ids) == (
        "<|im_start|>user\nQ7:<|endoftext|>\n<|im_start|>assistant\ngo</a>\n<|endoftext|>\n<|im_start|>tool\n"
        "<obs 1><|endoftext|>\n<|im_start|>assistant\ndone")  # the observation as the template renders it


def test_a_template_that_raises_on_the_role():
    no_tool = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
               "{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(TemplateSplitError, match=r"failed on a conversation of roles \['user', 'assistant', "
                                                 r"'tool'\]: .*no tool role.* env\.observation_role=user"):
        check_chat_turns(shipped_with(no_tool), "tool")
    check_chat_turns(shipped_with(no_tool), "user")  # that template takes the user role


def test_chat_needs_a_chat_template():
    with pytest.raises(TemplateSplitError, match=r"the run's tokenizer \(the shipped one\) has none"):
        check_chat_turns(RunTokenizer(load_tokenizer()), "tool")
    with pytest.raises(EpisodeError, match=r"has none"):
        play(FakeEngine([[1]]), chat_env(), RunTokenizer(load_tokenizer()))


def test_text_observations_are_unchanged_by_default():
    tok = shipped_with(QWEN_TOOLS)
    a1 = enc(tok, "go</a>")
    traj = play(FakeEngine([a1, enc(tok, "done")]), ToyEnv(done_after=2), tok)
    assert tok.text(traj.token_ids).endswith("<|im_start|>assistant\ngo</a><obs 1>\ndone")


def test_the_runs_setting_reaches_the_rollout_workers(tmp_path):
    from saorl.config import load_config
    from saorl.models.codec import run_tokenizer
    from saorl.runtime.backends.worker import build_worker
    from saorl.runtime.parts import worker_spec

    for over, want in (([], ("text", "tool")), (["env.observation_format=chat", "env.observation_role=user"],
                                                ("chat", "user"))):
        cfg = load_config(None, over)
        stack = build_worker(worker_spec(cfg, tmp_path, cfg.model.policy, run_tokenizer(cfg.model)))
        try:
            env = stack.env_factory()
            assert (env.observation_format, env.observation_role) == want
        finally:
            stack.engine.close()
            stack.env_factory.close()


def test_a_prompt_cut_to_its_budget_is_the_conversation_the_turns_continue():
    """env.overlong_prompts=truncate cuts the prompt's start (Task.prompt_limit) and the chat turns
    continue the cut conversation (they are rendered from the cut prompt, the one the model saw)."""
    from dataclasses import replace

    tok = shipped_with(QWEN_TOOLS)

    class LongToy(ToyEnv):
        def reset(self, task, progress=None):
            return [{"role": "user", "content": "background " * 60 + "Q7:"}]

    env = LongToy(done_after=2)
    env.observation_format = "chat"
    task = replace(TASK, prompt_limit=40)
    traj = asyncio.run(run_episode(FakeEngine([[*enc(tok, "go</a>"), tok.eos_token_id], enc(tok, "done")]),
                                   env, task, tok, sampling=SP, max_total_tokens=1024))
    assert traj.prompt_len <= 40
    text = tok.text(traj.token_ids)
    cut = text[:text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
    assert cut.startswith("<|im_start|>user\n") and cut.count("background") < 60 and "Q7:" in cut
    assert text == cut + ("go</a><|endoftext|>\n<|im_start|>user\n<tool_response>\n<obs 1>\n\n"
                          "</tool_response><|endoftext|>\n<|im_start|>assistant\ndone")


def test_the_probe_names_a_tokenizer_that_cannot_append_the_templates_text_exactly():
    class EncodesAlone(RunTokenizer):  # ignores the context: SentencePiece's dummy prefix adds a "▁"
        def continuation_ids(self, context, text):
            return self.ids(text)

    hf = sp_tokenizer(metaspace=False)
    hf.chat_template = SP_TOOLS
    check_chat_turns(RunTokenizer(hf), "tool")
    with pytest.raises(TemplateSplitError, match=(
            r"in a probe episode the ids appended after action 1 decode to "
            r"' \[TOOL\] <out>42</out> \[/TOOL\]', while the chat template writes "
            r"'\[TOOL\] <out>42</out> \[/TOOL\]' \(they part at character 0.*"
            r"cannot encode the template's text exactly after the context")):
        check_chat_turns(EncodesAlone(hf), "tool")
