"""Reward functions as ``prompt_reward`` calls them, in its two styles.

``correct`` is saorl's per-completion style, ``fn(prompt, completion, **row) -> float``: ``row``
holds the dataset's other columns (here ``answer`` and ``solution``); take the ones you need by
name and let ``**row`` swallow the rest. ``brief`` is TRL's ``GRPOTrainer`` style, lists in and
a list out, ``fn(prompts, completions, **kwargs) -> list[float]``, which a TRL reward function
already has; saorl tells the two apart by the parameter names.
"""

import re


def correct(prompt: str, completion: str, answer: int, **row) -> float:
    """1.0 if the first number in the completion is the answer, else 0.0."""
    match = re.search(r"-?\d+", completion)
    return 1.0 if match and int(match.group()) == answer else 0.0


def brief(completions: list[str], **kwargs) -> list[float]:
    """1.0 for each completion of at most 4 characters (after stripping spaces), else 0.0."""
    return [1.0 if len(c.strip()) <= 4 else 0.0 for c in completions]
