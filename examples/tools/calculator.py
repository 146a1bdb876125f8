"""A calculator as TRL users write tools: typed, documented functions, and a reward function.

``env.tools: [calculator:add, calculator:multiply]`` offers them to the model as
``GRPOTrainer(tools=[add, multiply])`` does; ``correct_answer`` scores the model's final reply
(docs/agents.md). Run with ``PYTHONPATH=examples/tools``.
"""

from __future__ import annotations

import re


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def _number(value: str) -> float | None:
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", value)
    return float(found[-1].replace(",", "")) if found else None


def correct_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the model's final reply is the answer, else 0.0 (TRL-style:
    lists in, one reward per completion; a completion is the conversation after the prompt, its
    last message the final reply)."""
    out = []
    for completion, want in zip(completions, answer):
        final = completion[-1]["content"] if isinstance(completion, list) else completion
        got = _number(final)
        out.append(1.0 if got is not None and abs(got - float(want)) < 1e-6 else 0.0)
    return out


def used_a_tool(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion called a tool (a shaping term; weight it low or leave it out)."""
    return [1.0 if isinstance(c, list) and any(m.get("role") == "tool" for m in c) else 0.0
            for c in completions]
