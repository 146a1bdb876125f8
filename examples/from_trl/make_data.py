"""Write the "From TRL" example's data into OUT_DIR: a conversational dataset as TRL takes it, and a
verl-style parquet file of the same problems.

- ``train.jsonl``, ``test.jsonl``: sums ``a+b`` (a up to 20, b up to 9), one row per line, no
  ``id`` (as a Hub dataset's JSONL has none), ``prompt`` a list of chat messages (a system
  message, then the question), ``answer`` the number the reward functions check and
  ``solution`` the reference reply (as TRL's own ``accuracy_reward`` reads it; saorl's SFT warm
  start can learn from it) — TRL's conversational prompt-only format;
- ``verl_train.parquet``: verl's layout, ``data_source``, ``prompt`` (the messages), ``ability``,
  ``reward_model: {style: rule, ground_truth}`` and ``extra_info`` (needs pyarrow);
- ``tokenizer/``: the tiny built-in model's tokenizer with a ChatML chat template, because a
  conversation can only go through a chat template and the tiny model's tokenizer has none (a real
  instruct model brings its own: drop ``model.tokenizer`` then).

    python examples/from_trl/make_data.py data/from_trl [--train 150 --test 16 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "Reply with the number only."
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def row(a: int, b: int) -> dict:
    """One problem, ``a+b``, as a conversation with its answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}]
    return {"prompt": messages, "answer": a + b, "solution": str(a + b)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=150)
    p.add_argument("--test", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    problems = [(a, b) for a in range(1, 21) for b in range(1, 10)]  # 180: train and test share none
    random.Random(args.seed).shuffle(problems)
    if args.train + args.test > len(problems):
        p.error(f"--train + --test must be at most {len(problems)}")
    test = [row(a, b) for a, b in problems[:args.test]]
    train = [row(a, b) for a, b in problems[args.test:args.test + args.train]]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("test", test)):
        (args.out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        print("pyarrow is not installed: no verl_train.parquet (pip install -e '.[data]')")
    else:
        verl = [{"data_source": "one_digit_sums", "prompt": r["prompt"], "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": str(r["answer"])},
                 "extra_info": {"split": "train", "index": i}} for i, r in enumerate(train)]
        pq.write_table(pa.Table.from_pylist(verl), args.out_dir / "verl_train.parquet")
    from saorl.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(args.out_dir / "tokenizer"))
    print(f"wrote {len(train)} train and {len(test)} test rows and a chat tokenizer to {args.out_dir}")


if __name__ == "__main__":
    main()
