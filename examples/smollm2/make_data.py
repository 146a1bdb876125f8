"""Write the real-model recipe's data (configs/recipes/smollm2_135m_sums.yaml) into OUT_DIR.

Sums ``a+b`` (a in 1..20, b in 1..12: 240 problems), shuffled with ``--seed``, ``--test`` of them
held out and the rest trained on; train and test share no problem. Each row is TRL's
conversational prompt-only format: ``prompt`` one user message that states the format ("Answer
with just the number."), ``answer`` the number the reward checks. No system message: SmolLM2's
chat template then adds its own, the one the model was tuned with (a system message of ours made
its answers worse: docs/real-model.md).

    python examples/smollm2/make_data.py data/smollm2_sums [--test 64 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "What is {a}+{b}? Answer with just the number."


def row(a: int, b: int) -> dict:
    """One problem as a one-message conversation with its answer."""
    return {"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": a + b}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    problems = [(a, b) for a in range(1, 21) for b in range(1, 13)]
    if not 0 < args.test < len(problems):
        p.error(f"--test must be between 1 and {len(problems) - 1}")
    random.Random(args.seed).shuffle(problems)
    test, train = problems[:args.test], problems[args.test:]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("test", test)):
        (args.out_dir / f"{name}.jsonl").write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in split))
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out_dir}")


if __name__ == "__main__":
    main()
