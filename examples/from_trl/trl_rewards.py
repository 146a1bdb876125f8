"""Two reward functions written for TRL's ``GRPOTrainer``, as they would be passed to it
(``reward_funcs=[format_reward, correctness_reward], reward_weights=[0.5, 1.0]``): lists in, a
list out, the dataset's other columns (here ``answer``) by keyword, completions of a
conversational dataset as ``[{"role": "assistant", "content": ...}]``. saorl calls them the same
way, with lists of one.
"""

import re


def format_reward(completions, **kwargs):
    """1.0 for a reply that is a number and nothing else (spaces aside), else 0.0."""
    texts = [completion[0]["content"] for completion in completions]
    return [1.0 if re.fullmatch(r"\s*-?\d+\s*", text) else 0.0 for text in texts]


def correctness_reward(completions, answer, **kwargs):
    """1.0 when the reply's first number is the answer, else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer):
        match = re.search(r"-?\d+", completion[0]["content"])
        scores.append(1.0 if match and int(match.group()) == int(expected) else 0.0)
    return scores
