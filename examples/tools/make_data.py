"""Write the calculator tool task's data (configs/recipes/smollm2_135m_tools.yaml) into OUT_DIR.

The task of docs/real-model.md's agentic recipe, as a TRL user writes it with ``tools=``:
products of a 2-digit and a 3-digit number (``Compute 38*114.``), which the model may work out
with the ``multiply`` / ``add`` tools of ``calculator.py``. Each row is TRL's conversational
prompt-only format: ``prompt`` one user message, ``answer`` the number ``correct_answer`` checks,
``demo`` a demonstration (a ``multiply`` call, then its result: ``multiply`` returns a float).
Train and test share no problem (``--test`` held out, shuffled with ``--seed``).

A share of the demonstrations fail (``--demo-error-rate``, 0.4 by default), as a human's would: a
product guessed without the tool, a digit mistyped in the call, or the result copied with a typo.
An SFT on them teaches the call format but not perfect use of it, so RL has something left to
learn (with every demonstration right the SFT alone solves the task: docs/agents.md).

``--tiny-tokenizer`` also writes ``tokenizer/``: the tiny built-in model's tokenizer with a ChatML
chat template (it has none, and tools need one), for ``configs/examples/tools_tiny.yaml``.

    python examples/tools/make_data.py data/tools [--test 64 --seed 0 --demo-error-rate 0.4]
        [--tiny-tokenizer]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "Compute {a}*{b}. Use the multiply tool, then answer with just the number."
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _typo(n: int, rng: random.Random) -> int:
    """``n`` with one digit changed (never its leading digit to 0)."""
    digits = list(str(n))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def demo(a: int, b: int, rng: random.Random | None = None) -> list[str]:
    """The actions of a demonstration: the call, then the reply that copies its result; with an
    ``rng`` (a failing one) one of three mistakes: no call and a guessed product, a mistyped operand
    in the call (its wrong result copied), or the right call's result copied with a typo."""
    def call(x: int, y: int) -> str:
        body = json.dumps({"name": "multiply", "arguments": {"a": x, "b": y}})
        return f"<tool_call>{body}</tool_call>"

    if rng is None:
        return [call(a, b), f"{float(a * b)}"]
    kind = rng.choice(("guess", "call", "copy"))
    if kind == "guess":
        return [f"{_typo(a * b, rng)}"]
    if kind == "call":
        wrong = _typo(b, rng)
        return [call(a, wrong), f"{float(a * wrong)}"]
    return [call(a, b), f"{float(_typo(a * b, rng))}"]


def row(a: int, b: int, rng: random.Random | None = None) -> dict:
    """One problem as a one-message conversation with its answer, and a demonstration (for an SFT
    warm start, ``env.options.demo_column: demo``): right, or failing when given an ``rng``."""
    return {"id": f"{a}x{b}", "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "answer": a * b, "demo": demo(a, b, rng)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo-error-rate", type=float, default=0.4,
                   help="share of the train rows whose demonstration fails (test rows' are all right)")
    p.add_argument("--tiny-tokenizer", action="store_true")
    args = p.parse_args()
    if not 0.0 <= args.demo_error_rate <= 1.0:
        p.error(f"--demo-error-rate must be in [0, 1], got {args.demo_error_rate}")
    rng = random.Random(args.seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(100, 1000)], args.train + args.test)
    test, train = pairs[:args.test], pairs[args.test:]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    demo_rng = random.Random(args.seed + 1)
    rate = args.demo_error_rate
    rows = {"train": [row(a, b, demo_rng if demo_rng.random() < rate else None) for a, b in train],
            "test": [row(a, b) for a, b in test]}
    for name, split in rows.items():
        (args.out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split))
    if args.tiny_tokenizer:
        from saorl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(str(args.out_dir / "tokenizer"))
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out_dir}")


if __name__ == "__main__":
    main()
