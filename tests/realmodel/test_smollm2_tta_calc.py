"""``bench_tta.py --task calc`` on SmolLM2's own tokenizer: the evaluator builds, turn by turn, the
very tokens saorl's episode with ``env.tools`` has (the tools' system message, the call, the tool
turn, the answer), so every arm and the evaluator see the same conversation."""

from __future__ import annotations

import asyncio

from tests.bench.bench_scripts import load_benchmark


def test_the_evaluators_turns_are_the_saorl_episodes_tokens(smollm2):
    from transformers import AutoTokenizer

    from saorl.agent import ScriptedEngine, run_episode
    from saorl.config import load_config
    from saorl.engines.base import SamplingParams
    from saorl.envs.base import Task
    from saorl.envs.registry import make_env_factory, tool_options_for
    from saorl.models.codec import RunTokenizer

    calc = load_benchmark("bench_tta").tta_calc
    hf = AutoTokenizer.from_pretrained(str(smollm2))
    cfg = load_config(None, ["env.type=prompt_reward", "env.tasks_file=unused.jsonl",
                             *calc.saorl_overrides(calc.MAX_NEW)])
    _, [row] = calc.problems(1, 1, seed=3)
    a, b = map(int, row["id"].split("x"))
    call = f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    with make_env_factory("prompt_reward", dict(cfg.env.options), tool_options=tool_options_for(cfg.env),
                          observation_role=cfg.env.observation_role) as make:
        traj = asyncio.run(run_episode(ScriptedEngine(hf, [call, str(a * b)]), make(), Task(row["id"], row),
                                       RunTokenizer(hf), sampling=SamplingParams(max_new_tokens=calc.MAX_NEW),
                                       max_total_tokens=640))
    assert traj.episode.final_reward == 1.0
    eos = hf.eos_token_id
    prompt = hf.apply_chat_template(calc.messages(row["prompt"]), add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    turn = [*hf.encode(call, add_special_tokens=False), eos]
    result = calc.run_call(*calc.parse_call(call))
    assert result == str(a * b)
    answer = [*hf.encode(str(a * b), add_special_tokens=False), eos]
    assert traj.token_ids == prompt + turn + calc.after_call(hf, turn, result) + answer
    tool_turn = f"\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n"
    assert hf.decode(calc.after_call(hf, turn, result)) == tool_turn


def test_the_trl_arms_template_writes_tool_calls_and_renders_the_rest_as_smollm2s(smollm2):
    """TRL takes tools only with a template that writes tool calls, which SmolLM2's does not: the
    TRL arm's template adds them, every other message rendered as SmolLM2's own renders it."""
    from transformers import AutoTokenizer

    calc = load_benchmark("bench_tta").tta_calc
    hf = AutoTokenizer.from_pretrained(str(smollm2))
    _, rows = calc.problems(1, 3, seed=1)
    user = {"role": "user", "content": "Q"}
    turns = [user, {"role": "assistant", "content": "A"}, {"role": "tool", "content": "5"}]
    convs = [*(calc.messages(r["prompt"]) for r in rows), turns]
    before = [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    hf.chat_template = calc.with_tool_calls(hf.chat_template)
    assert [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs] == before
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    text = hf.apply_chat_template([user, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                  tokenize=False)
    assert text.endswith('<|im_start|>assistant\n<tool_call>{"name": "multiply", '
                         '"arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>\n')
    assert calc.parse_call(text) == ("multiply", {"a": 3, "b": 4})
