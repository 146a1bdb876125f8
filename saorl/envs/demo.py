"""Demonstrations played as text through an env (``saorl envs sample``, the env tests).

The env computes observations and rewards; nothing is tokenized except for the counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from saorl.envs.base import Env, Progress, Prompt, Task, prompt_text


@dataclass
class DemoEpisode:
    prompt: Prompt
    turns: list[tuple[str, str]] = field(default_factory=list)
    """(action, observation) pairs in order."""
    reward: float = 0.0
    success: bool = False
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def play_demonstration(env: Env, task: Task, rng: random.Random,
                       progress: Progress | None = None) -> DemoEpisode:
    """Reset ``env`` on ``task`` and step the demonstration's actions until the episode ends."""
    ep = DemoEpisode(env.reset(task, progress))
    for action in env.demonstration(task, rng):
        result = env.step(action)
        ep.turns.append((action, result.observation))
        ep.reward += result.reward
        if result.done:
            ep.done, ep.info = True, result.info
            ep.success = bool(result.info.get("success", False))
            break
    return ep


def token_counts(ep: DemoEpisode, tokenizer: Any) -> dict[str, int]:
    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    counts = {"prompt": n(prompt_text(ep.prompt)), "actions": sum(n(a) for a, _ in ep.turns),
              "observations": sum(n(o) for _, o in ep.turns)}
    counts["max_action"] = max((n(a) for a, _ in ep.turns), default=0)
    counts["total"] = counts["prompt"] + counts["actions"] + counts["observations"]
    return counts
