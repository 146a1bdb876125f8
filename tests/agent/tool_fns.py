"""Tools and a reward function for the tool-calling tests (imported by name, in hosted children too)."""

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def explode(x: int) -> int:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


def hang(x: int) -> int:
    """Never returns.

    Args:
        x: Anything.
    """
    time.sleep(10**6)
    return x


def nodoc(x: int) -> int:
    return x


def reward(prompts, completions, **kwargs):
    """1 when the final reply says 5 and a tool answered 5; records what it got."""
    reward.seen = completions
    out = []
    for c in completions:
        tool_said = any(m["role"] == "tool" and m["content"] == "5" for m in c)
        out.append(1.0 if tool_said and "5" in c[-1]["content"] else 0.0)
    return out
