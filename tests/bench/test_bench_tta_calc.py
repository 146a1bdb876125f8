"""``bench_tta.py --task calc``: the calculator problems, the evaluator's turns (a call run, its
result as a ``tool`` turn, the answer scored) against a scripted model, the refusal of a model
without a chat template, and the saorl arm end to end on the tiny model with a ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load_benchmark

tta = load_benchmark("bench_tta")
calc = tta.tta_calc
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_problems_are_disjoint_products_with_their_answers():
    train, test = calc.problems(300, 40, seed=2)
    assert len(train) == 300 and len(test) == 40 and not {r["id"] for r in train} & {r["id"] for r in test}
    for r in train[:50] + test:
        a, b = map(int, r["id"].split("x"))
        assert r["answer"] == a * b and 10 <= a <= 99 and 100 <= b <= 999 and "demo" not in r
        assert r["prompt"] == [{"role": "user", "content": f"Compute {a}*{b}. Use the multiply tool, then "
                                                           "answer with just the number."}]
    with pytest.raises(ValueError, match="train \\+ test"):
        calc.problems(90_000, 1)


@pytest.mark.parametrize(("text", "call"), [
    ('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>',
     ("multiply", {"a": 3, "b": 4})),
    ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     ("add", {"a": 1, "b": 2})),
    ('<tool_call>{"name": "divide", "arguments": {"a": 3}}</tool_call>', None),
    ('<tool_call>{"name": "multiply", "arguments": [3, 4]}</tool_call>', None),
    ("<tool_call>not json</tool_call>", None), ("12", None),
])
def test_parse_call(text, call):
    assert calc.parse_call(text) == call


def test_a_template_of_another_form_is_not_extended():
    with pytest.raises(ValueError, match="SmolLM2's ChatML form"):
        calc.with_tool_calls(CHATML)


def test_a_tools_bad_arguments_come_back_as_an_error_text():
    assert calc.run_call("multiply", {"a": 66, "b": 194}) == "12804"
    assert "TypeError" in json.loads(calc.run_call("multiply", {"a": 1}))["error"]


def _chat_tokenizer():
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = CHATML
    return tok


class _Scripted:
    """A model whose greedy turns are given texts; it records the prompt ids of each row's turns."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok, self.turns, self.seen = tok, turns, []

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, **kw):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = [t for t, m in zip(ids, mask) if m]
            self.seen.append(prompt)
            text = self.turns[min(len(self.seen) - 1, len(self.turns) - 1)]
            reply = [*self.tok.encode(text, add_special_tokens=False)[:max_new_tokens - 1], eos_token_id]
            rows.append(ids + reply + [eos_token_id] * (max_new_tokens - len(reply)))
        return torch.tensor(rows)


def test_the_evaluator_runs_the_call_and_scores_the_answer_after_it(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = _chat_tokenizer()
    tok.save_pretrained(tmp_path)
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 66, "b": 194}}</tool_call>'
    model = _Scripted(tok, [call, "12804"])
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **kw: tok)
    row = {"id": "66x194", "prompt": [{"role": "user", "content": "Compute 66*194."}], "answer": 12804}
    [got] = calc.evaluate(tmp_path, [row], True, 48)
    assert got["correct"] and got["calls"] == 1 and got["turns"] == 2 and got["reply"] == "12804"
    assert got[calc.FLAG] and calc.accuracy([got]) == 1.0
    first = tok.apply_chat_template(calc.messages(row["prompt"]), add_generation_prompt=True, tokenize=True)
    first = list(first["input_ids"] if hasattr(first, "keys") else first)
    eos = tok.eos_token_id
    a1 = [*tok.encode(call, add_special_tokens=False), eos]
    assert model.seen[0] == first
    # the second turn sees the first, the end of its turn, the tool turn with the result, a new header
    after = tok.decode(model.seen[1][len(first) + len(a1):])
    assert model.seen[1][:len(first) + len(a1)] == first + a1
    assert after.endswith("<|im_start|>tool\n12804<|im_end|>\n<|im_start|>assistant\n")
    model2 = _Scripted(tok, [call])  # a call in every turn: the last one is the reply, no answer
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: model2)
    [got] = calc.evaluate(tmp_path, [row], True, 48)
    assert got["turns"] == calc.TURNS and got["calls"] == calc.TURNS - 1 and not got["correct"]


def test_a_model_without_a_chat_template_is_refused(tmp_path, capsys):
    argv = ["--task", "calc", "--model", "tiny-dense", "--arms", "grpo", "--out", str(tmp_path)]
    assert tta.main(argv) == 2
    assert "needs a model with a chat template" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_saorl_arm_end_to_end_on_a_chat_template(tmp_path: Path):
    from saorl.models.tiny import build_tiny

    model = tmp_path / "model"
    build_tiny("tiny-dense", seed=0).save_pretrained(model)
    _chat_tokenizer().save_pretrained(model)
    out = tmp_path / "tta"
    assert tta.main(["--task", "calc", "--model", str(model), "--arms", "grpo", "--seeds", "1",
                     "--budget-s", "20", "--test-n", "4", "--train-n", "40", "--fractions", "1",
                     "--batch", "4", "--group", "2", "--max-new", "8", "--out", str(out)]) == 0
    cfg = (out / "seed0" / "grpo" / "run" / "config.yaml").read_text()
    assert "calculator:multiply" in cfg and "tool_stop: false" in cfg and "observation_role: tool" in cfg
    [row] = [json.loads(line) for line in open(out / "results.jsonl")]
    gens = [json.loads(line) for line in open(row["generations"])]
    assert len(gens) == 4 and row["accuracy"] == calc.accuracy(gens) and "called_frac" in row
    assert all(1 <= g["turns"] <= calc.TURNS for g in gens)
