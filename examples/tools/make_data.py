"""Write the calculator tool task's data (configs/recipes/smollm2_135m_tools.yaml) into OUT_DIR.

The task of docs/real-model.md's agentic recipe, as a TRL user writes it with ``tools=``:
products of a 2-digit and a 3-digit number (``Compute 38*114.``), which the model may work out
with the ``multiply`` / ``add`` tools of ``calculator.py``. Each row is TRL's conversational
prompt-only format: ``prompt`` one user message, ``answer`` the number ``correct_answer`` checks,
``demo`` a demonstration (a ``multiply`` call, then its result: ``multiply`` returns a float).
Train and test share no problem (``--test`` held out, shuffled with ``--seed``).

``--tiny-tokenizer`` also writes ``tokenizer/``: the tiny built-in model's tokenizer with a ChatML
chat template (it has none, and tools need one), for ``configs/examples/tools_tiny.yaml``.

    python examples/tools/make_data.py data/tools [--test 64 --seed 0] [--tiny-tokenizer]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "Compute {a}*{b}. Use the multiply tool, then answer with just the number."
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def row(a: int, b: int) -> dict:
    """One problem as a one-message conversation with its answer, and a demonstration: the call,
    then the reply that copies its result (for an SFT warm start, ``env.options.demo_column: demo``)."""
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    return {"id": f"{a}x{b}", "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "answer": a * b, "demo": [f"<tool_call>{call}</tool_call>", f"{float(a * b)}"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny-tokenizer", action="store_true")
    args = p.parse_args()
    rng = random.Random(args.seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(100, 1000)], args.train + args.test)
    test, train = pairs[:args.test], pairs[args.test:]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("test", test)):
        (args.out_dir / f"{name}.jsonl").write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in split))
    if args.tiny_tokenizer:
        from saorl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(str(args.out_dir / "tokenizer"))
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out_dir}")


if __name__ == "__main__":
    main()
