"""Write a small arithmetic dataset as parquet: ``train.parquet`` and ``test.parquet`` in OUT_DIR.

Rows have a ``prompt`` column (what the policy sees), an ``answer`` column (what the reward
function checks) and a ``solution`` column (a reference completion, usable as SFT
demonstrations with ``env.options.demo_column=solution``). Train and test share no problem.

    python examples/prompt_reward/make_data.py data/arith [--train 2000 --test 200 --seed 0]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path


def arithmetic_rows(n: int, rng: random.Random, exclude: set[str] = frozenset()) -> list[dict]:
    """``n`` distinct problems ``a op b`` (two-digit operands, + - *), no prompt of which is in
    ``exclude``."""
    rows: dict[str, dict] = {}
    while len(rows) < n:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
        prompt = f"What is {a}{op}{b}? Answer: "
        if prompt in exclude or prompt in rows:
            continue
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows[prompt] = {"prompt": prompt, "answer": answer, "solution": f"{answer}"}
    return list(rows.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(args.seed)
    train = arithmetic_rows(args.train, rng)
    test = arithmetic_rows(args.test, rng, exclude={r["prompt"] for r in train})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(rows), args.out_dir / f"{name}.parquet")
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out_dir}")


if __name__ == "__main__":
    main()
