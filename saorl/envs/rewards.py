"""Ready-made reward functions for ``prompt_reward`` (``env.options.reward_fn=saorl.envs.rewards:NAME``).

Each has the signature the env calls, ``fn(prompt, completion, **row) -> float``, and doubles as
an example of writing your own: take the columns you need by name, swallow the rest with
``**row``, return a finite number. For conversational data the completion arrives as TRL passes
it, ``[{"role": "assistant", "content": text}]``; :func:`completion_text` reads either form.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234`` reads as 1234; after ``####`` if there is one,
    as in GSM8K's answers), or None."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The completion's text: the text itself, or the content of a conversational completion's last
    message."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def number_answer(prompt: Any, completion: str | list[dict[str, Any]], answer: Any, **row: Any) -> float:
    """1.0 when the last number in ``completion`` equals the row's ``answer`` (a number, or text whose
    last number is taken, e.g. a GSM8K solution ending ``#### 72``), else 0.0."""
    target = answer if isinstance(answer, (int, float)) else last_number(str(answer))
    if target is None:
        raise ValueError(f"the answer column holds no number: {answer!r}")
    got = last_number(completion_text(completion))
    return 1.0 if got is not None and abs(got - float(target)) < 1e-9 else 0.0
