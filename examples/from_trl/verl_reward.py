"""A verl-style reward function, ``compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float``, and the three lines that let saorl call it on verl's parquet rows.

saorl calls a per-completion function as ``fn(prompt, completion, **row)``, the row's columns by
name; a verl row holds the answer in ``reward_model["ground_truth"]``, so ``verl_score`` unpacks
it and hands verl's arguments on.
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1.0 when the solution's last number is the ground truth, else 0.0."""
    numbers = re.findall(r"-?\d+", solution_str)
    return 1.0 if numbers and numbers[-1] == str(ground_truth).strip() else 0.0


def verl_score(prompt, completion, data_source, reward_model, extra_info=None, **row):
    text = completion if isinstance(completion, str) else completion[0]["content"]
    return compute_score(data_source, text, reward_model["ground_truth"], extra_info)
