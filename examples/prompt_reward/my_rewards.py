"""A reward function as ``prompt_reward`` calls it: ``fn(prompt, completion, **row) -> float``.

``row`` holds the dataset's other columns (here ``answer`` and ``solution``); take the ones you
need by name and let ``**row`` swallow the rest.
"""

import re


def correct(prompt: str, completion: str, answer: int, **row) -> float:
    """1.0 if the first number in the completion is the answer, else 0.0."""
    match = re.search(r"-?\d+", completion)
    return 1.0 if match and int(match.group()) == answer else 0.0
