"""The multi-turn task of ``bench_tta.py`` (``--task calc``): a calculator the model calls as a tool.

The calculator task of ``examples/tools/`` (docs/agents.md): ``Compute 38*114. Use the multiply
tool, then answer with just the number.``, a 2-digit × 3-digit product, with ``add`` and
``multiply`` (``examples/tools/calculator.py``) as tools, as ``GRPOTrainer(tools=[add, multiply])``
takes them; reward and accuracy: ``calculator:correct_answer`` (the last number of the final reply
is the product). Up to :data:`TURNS` model turns (two calls, then an answer), ``--max-new`` new
tokens each (:data:`MAX_NEW`, 48, unless given).

Every arm sees the same tokens. The tools are described in a system message written by saorl's
:func:`~saorl.envs.tool_prompt.with_tool_system_prompt` (Qwen2.5's tool prompt, the ``hermes``
call format: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), which SmolLM2's chat
template, reading no ``tools``, leaves as it is; a result comes back as a ``tool`` turn of the
template (``<|im_start|>tool\\n1638.0<|im_end|>``). The saorl arms get this from ``env.tools`` with
``env.tool_prompt: json``, ``env.observation_role: tool`` and ``env.tool_stop: false`` (the model
ends its turn itself, as under TRL); the TRL arm gets the rows with the system message already in
them and ``tools=[add, multiply]``, with the tokenizer's ``response_template`` set to the one TRL
uses for this ChatML call format (``trl.chat_template_utils.qwen3_template``: TRL knows no
SmolLM2 template). The evaluator (:func:`evaluate`) plays the turns itself with transformers'
``generate``: its own call parser (the first ``<tool_call>`` JSON of a turn), the calculator's
functions, the ``tool`` turn rendered by the tokenizer's template. One difference stays, TRL's
design: it caps the whole conversation after the prompt (``max_completion_length``, here
``TURNS · max_new + 64`` tokens, tool turns included), saorl and the evaluator each turn.

SmolLM2-135M-Instruct as it is never makes a well-formed call (docs/agents.md), so every arm starts
from an SFT model that learned the call format: ``--model`` names it (``saorl sft`` of
``configs/recipes/smollm2_135m_tools.yaml`` with ``env.tool_stop=false``; docs/performance.md).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOLS_DIR = ROOT / "examples" / "tools"
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

import calculator  # noqa: E402
import make_data  # noqa: E402
import tta_eval  # noqa: E402

FLAG = "called"
"""The share of episodes the summary reports beside accuracy: those that called a tool."""
TURNS = 3
MAX_NEW = 48
"""New tokens a turn (``--max-new``) unless given."""
TOOLS = ("add", "multiply")
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def problems(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``n_train`` train and ``n_test`` held-out rows of ``make_data.row`` (``prompt``, ``answer``,
    ``id``; no pair in both)."""
    pool = [(a, b) for a in range(10, 100) for b in range(100, 1000)]
    if n_train < 1 or n_test < 1 or n_train + n_test > len(pool):
        raise ValueError(f"need 1 <= train, 1 <= test and train + test <= {len(pool)} problems, "
                         f"got train={n_train}, test={n_test}")
    pairs = random.Random(seed).sample(pool, n_train + n_test)
    rows = [make_data.row(a, b) for a, b in pairs]
    for r in rows:
        r.pop("demo")
    return rows[n_test:], rows[:n_test]


def write_tasks(rows: list[dict], path: Path, chat: bool) -> Path:
    if not chat:
        raise ValueError("--task calc needs a model with a chat template (its tool turns are chat turns)")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def saorl_overrides(max_new: int) -> list[str]:
    """The saorl arms' env and rollout settings (``PYTHONPATH`` has ``examples/tools``)."""
    return [f"env.tools=[{', '.join(f'calculator:{t}' for t in TOOLS)}]", "env.tool_prompt=json",
            "env.tool_stop=false", f"env.tool_max_turns={TURNS}", "env.observation_role=tool",
            "env.options.reward_fn=calculator:correct_answer", "env.options.success_threshold=1.0",
            f"rollout.max_new_tokens={max_new}", f"rollout.max_total_tokens={768 + TURNS * max_new}"]


def schemas() -> list[dict[str, Any]]:
    """The tools' JSON schemas as saorl's ``env.tools`` and TRL's ``tools=`` make them."""
    from saorl.envs.tool_calls import function_schema

    return [function_schema(getattr(calculator, t)) for t in TOOLS]


def messages(prompt: list[dict[str, str]]) -> list[dict[str, str]]:
    """The row's conversation with the tools' system message, as the saorl arms render it."""
    from saorl.envs.tool_prompt import with_tool_system_prompt

    return with_tool_system_prompt(prompt, schemas(), "json", "hermes")


_CONTENT = "+ message['content'] + '<|im_end|>' + '\n'}}"
_CONTENT_AND_CALLS = ("+ (message['content'] or '')}}{% for tc in message.tool_calls or [] %}"
                      "{{ '<tool_call>' + (tc.function | tojson) + '</tool_call>' }}{% endfor %}"
                      "{{ '<|im_end|>' + '\n' }}")


def with_tool_calls(template: str) -> str:
    """A ChatML template of SmolLM2's form that also writes an assistant message's ``tool_calls`` (as
    ``<tool_call>{...}</tool_call>`` after its content), which TRL requires of a template before it
    takes tools; every other message renders as before. ValueError for a template of another form."""
    if _CONTENT not in template:
        raise ValueError("--task calc: the model's chat template does not write tool calls and is not of "
                         "SmolLM2's ChatML form, which this benchmark knows how to extend")
    return template.replace(_CONTENT, _CONTENT_AND_CALLS)


def trl_arm(rows: list[dict], tok, max_new: int) -> dict[str, Any]:
    """What TRL's ``GRPOTrainer`` is given: the rows with the system message in their prompts, the
    tools, the reward; ``tok`` gets the response template TRL parses calls with and, when its chat
    template drops tool calls (SmolLM2's), one that writes them (:func:`with_tool_calls`)."""
    from trl.chat_template_utils import qwen3_template, supports_tool_calling

    if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
        tok.response_template = qwen3_template
    if not supports_tool_calling(tok):
        tok.chat_template = with_tool_calls(tok.chat_template)
    return {"rows": [{"prompt": messages(r["prompt"]), "answer": r["answer"]} for r in rows],
            "tools": [getattr(calculator, t) for t in TOOLS], "reward_funcs": [calculator.correct_answer],
            "reward_weights": [1.0],
            # the whole conversation after the prompt: the turns and the tool turns between them
            "config": {"max_completion_length": TURNS * max_new + 64,
                       "max_tool_calling_iterations": TURNS - 1}}


def parse_call(text: str) -> tuple[str, dict] | None:
    """The first well-formed call of a turn to a known tool, else None."""
    m = _CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    name, args = call.get("name"), call.get("arguments")
    return (name, args) if name in TOOLS and isinstance(args, dict) else None


def run_call(name: str, args: dict) -> str:
    try:
        return str(getattr(calculator, name)(**args))
    except Exception as e:
        return json.dumps({"error": f"{type(e).__name__}: {e}"})


def tool_turn(tok, result: str) -> list[int]:
    """The tokens after a call's text: the end of the assistant's turn, the ``tool`` turn with
    ``result``, the next assistant header, as the template renders them after a turn's content."""
    call = {"role": "assistant", "content": "CALL"}
    turns = [{"role": "user", "content": "Q"}, call, {"role": "tool", "content": result}]
    after = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tok.encode(after[after.rindex("CALL") + len("CALL"):], add_special_tokens=False)


def after_call(tok, turn: list[int], result: str) -> list[int]:
    """What follows a turn's generated tokens ``turn`` (its end-of-turn token included when the model
    wrote it) once its call returned ``result``."""
    suffix, eos = tool_turn(tok, result), tok.eos_token_id
    return suffix[1:] if turn and turn[-1] == eos and suffix and suffix[0] == eos else suffix


def evaluate(ckpt: Path, rows: list[dict], chat: bool, max_new: int, batch: int = 32,
             temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """Greedy episodes of the model in ``ckpt`` on ``rows`` (module docstring), batched by turn:
    ``{"question", "answer", "reply", "turns", "calls", "correct"}`` per row. ``temperature`` > 0:
    sampled from the whole distribution instead (no top-k or top-p), torch seeded with ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    pad, eos = (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id), tok.eos_token_id
    decoding = tta_eval.sampling(temperature, seed)
    state = []
    for r in rows:
        ids = tok.apply_chat_template(messages(r["prompt"]), add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        state.append({"ids": ids, "reply": "", "turns": 0, "calls": 0, "done": False})
    for turn in range(TURNS):
        live = [s for s in state if not s["done"]]
        for i in range(0, len(live), batch):
            part = live[i:i + batch]
            width = max(len(s["ids"]) for s in part)
            ids = torch.tensor([[pad] * (width - len(s["ids"])) + s["ids"] for s in part])
            mask = torch.tensor([[0] * (width - len(s["ids"])) + [1] * len(s["ids"]) for s in part])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, **decoding,
                                     max_new_tokens=max_new, pad_token_id=pad, eos_token_id=eos,
                                     use_cache=True)
            for s, seq in zip(part, out[:, width:].tolist()):
                new = seq[:seq.index(eos) + 1] if eos in seq else seq
                text = tok.decode(new, skip_special_tokens=True)
                s["turns"] += 1
                s["reply"] = text
                call = parse_call(text) if turn < TURNS - 1 else None
                if call is None:
                    s["done"] = True
                    continue
                s["calls"] += 1
                s["ids"] = s["ids"] + new + after_call(tok, new, run_call(*call))
    out = []
    for r, s in zip(rows, state):
        correct = calculator.correct_answer(None, [[{"content": s["reply"]}]], [r["answer"]])[0] == 1.0
        out.append({"question": r["prompt"][-1]["content"], "answer": r["answer"], "reply": s["reply"],
                    "turns": s["turns"], "calls": s["calls"], "correct": correct, FLAG: s["calls"] > 0})
    return out


def accuracy(generations: list[dict]) -> float:
    """The fraction of episodes whose final reply's last number is the answer (recomputed)."""
    import statistics

    got = calculator.correct_answer(None, [[{"content": g["reply"]}] for g in generations],
                                    [g["answer"] for g in generations])
    return statistics.fmean(got)
