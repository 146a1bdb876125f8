"""The single-turn task of ``bench_tta.py``: arithmetic problems, their rewards and their accuracy.

Problems: ``a + b`` and ``a - b`` with two-digit operands (10..99), ``a * b`` with one-digit
operands (1..9), asked as ``What is 47 + 18? Reply with just the number.``; a model with a chat
template gets it as one user message, any other model as the text itself. Train and held-out
problems are disjoint (the held-out ones are drawn first, then excluded from the train draw).

Reward (the same functions for every arm: saorl's ``prompt_reward`` env names them
``tta_task:bare_integer`` and ``tta_task:last_integer_correct``, TRL's ``GRPOTrainer`` gets them as
``reward_funcs``, both weighted ``REWARD_WEIGHTS``): 0.5 when the reply is a bare integer (nothing
but an optionally signed run of digits, spaces around it allowed) + 1.0 when the last integer in
the reply is the answer. Accuracy (what the evaluator reports): the last integer in the reply is
the answer. The format term is a loophole a policy can fall into (bare wrong integers earn 0.5),
which the issue this benchmark answers saw two arms do; ``--format-reward W`` weights it W instead
(0: left out, the reward is the accuracy).

The functions take TRL's batched form, ``fn(completions=[...], answer=[...], **kw)``, where a
completion is a text or, for a conversation, ``[{"role": "assistant", "content": text}]``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

FLAG = "bare"
"""The share of replies the summary reports beside accuracy: bare integers (the loophole)."""
MAX_NEW = 24
"""The completion cap (``--max-new``) unless given."""
REWARD_FUNCS = ("bare_integer", "last_integer_correct")
REWARD_WEIGHTS = (0.5, 1.0)
_INT = re.compile(r"-?\d+")
_BARE = re.compile(r"\s*-?\d+\s*")


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? Reply with just the number."


def problems(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``n_train`` train and ``n_test`` held-out rows ``{"question", "answer"}``, no question in both."""
    pool = [(a, op, b) for op in "+-" for a in range(10, 100) for b in range(10, 100)]
    pool += [(a, "*", b) for a in range(1, 10) for b in range(1, 10)]
    if n_train < 1 or n_test < 1 or n_train + n_test > len(pool):
        raise ValueError(f"need 1 <= train, 1 <= test and train + test <= {len(pool)} problems, "
                         f"got train={n_train}, test={n_test}")
    rng = random.Random(seed)
    picked = rng.sample(pool, n_train + n_test)
    rows = [{"question": question(a, op, b), "answer": a + b if op == "+" else a - b if op == "-" else a * b}
            for a, op, b in picked]
    return rows[n_test:], rows[:n_test]


def prompt(q: str, chat: bool) -> str | list[dict[str, str]]:
    """What a trainer is given: one user message for a chat model, the text otherwise."""
    return [{"role": "user", "content": q}] if chat else q


def write_tasks(rows: list[dict], path: Path, chat: bool) -> Path:
    """``rows`` as a JSONL tasks file for ``prompt_reward`` (columns ``prompt``, ``answer``)."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"prompt": prompt(row["question"], chat), "answer": row["answer"]}) + "\n")
    return path


def reply_text(completion: str | list[dict[str, Any]]) -> str:
    return completion if isinstance(completion, str) else str(completion[-1].get("content") or "")


def last_integer(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def is_correct(reply: str, answer: int) -> bool:
    """The accuracy the evaluator counts: the last integer in ``reply`` is ``answer``."""
    return last_integer(reply) == int(answer)


def is_bare_integer(reply: str) -> bool:
    return _BARE.fullmatch(reply) is not None


def bare_integer(completions: list, **kw: Any) -> list[float]:
    """1.0 for a reply that is a bare integer, else 0.0 (weighted 0.5)."""
    return [float(is_bare_integer(reply_text(c))) for c in completions]


def last_integer_correct(completions: list, answer: list, **kw: Any) -> list[float]:
    """1.0 when the reply's last integer is the answer, else 0.0 (weighted 1.0)."""
    return [float(is_correct(reply_text(c), a)) for c, a in zip(completions, answer)]


def reward(reply: str, answer: int) -> float:
    """The weighted sum both trainers compute, for one reply."""
    return REWARD_WEIGHTS[0] * is_bare_integer(reply) + REWARD_WEIGHTS[1] * is_correct(reply, answer)


def reward_terms(format_reward: float = REWARD_WEIGHTS[0]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The reward functions and weights every arm is given: the bare-integer term weighted
    ``format_reward`` (``--format-reward``; 0 leaves it out: accuracy alone, no loophole)."""
    if format_reward == 0:
        return REWARD_FUNCS[1:], REWARD_WEIGHTS[1:]
    return REWARD_FUNCS, (format_reward, REWARD_WEIGHTS[1])


def saorl_overrides(max_new: int, format_reward: float = REWARD_WEIGHTS[0]) -> list[str]:
    """The saorl arms' env and rollout settings for this task."""
    funcs, weights = reward_terms(format_reward)
    return [f"env.options.reward_fn=[{', '.join(f'tta_task:{f}' for f in funcs)}]",
            f"env.options.reward_weights=[{', '.join(map(str, weights))}]",
            f"rollout.max_new_tokens={max_new}", f"rollout.max_total_tokens={max_new + 192}"]


def trl_arm(rows: list[dict], tok, max_new: int, format_reward: float = REWARD_WEIGHTS[0]) -> dict[str, Any]:
    """What TRL's ``GRPOTrainer`` is given (``rows``: the tasks file's)."""
    funcs, weights = reward_terms(format_reward)
    return {"rows": rows, "tools": None, "reward_funcs": [globals()[f] for f in funcs],
            "reward_weights": list(weights), "config": {"max_completion_length": max_new}}


def evaluate(ckpt: Path, rows: list[dict], chat: bool, max_new: int, temperature: float = 0.0,
             seed: int = 0) -> list[dict]:
    """Greedy replies (sampled at ``temperature`` > 0), scored (:func:`tta_eval.evaluate`)."""
    import tta_eval

    return tta_eval.evaluate(ckpt, rows, chat, max_new, temperature=temperature, seed=seed)


def accuracy(generations: list[dict]) -> float:
    """The fraction of replies whose last integer is the answer (:func:`tta_eval.accuracy`)."""
    import tta_eval

    return tta_eval.accuracy(generations)
