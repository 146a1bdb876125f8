"""Write arithmetic tasks for the calculator agent: ``train.jsonl`` and ``test.jsonl`` in OUT_DIR.

Each row: ``id``, ``question`` ("What is 37*41?"), ``answer`` (the integer). Train and test share
no problem.

    python examples/openai_agent/make_tasks.py data/calc [--train 2000 --test 200 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng, rows = random.Random(args.seed), {}
    while len(rows) < args.train + args.test:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
        question = f"What is {a}{op}{b}?"
        rows.setdefault(question, a + b if op == "+" else a - b if op == "-" else a * b)
    items = [{"id": f"calc-{i}", "question": q, "answer": v} for i, (q, v) in enumerate(rows.items())]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", items[:args.train]), ("test", items[args.train:])):
        with open(args.out_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)


if __name__ == "__main__":
    main()
