"""The one typed record that flows from rollout workers to the trainer.

A trajectory is a flat token sequence: the prompt, then the response, which interleaves
*action* tokens (sampled by the policy) and *observation* tokens (written by the environment).
Every per-token list has the same length as ``token_ids``:

- ``action_mask[t]``       1 for tokens the policy sampled, 0 for prompt / observation tokens.
- ``rollout_logprobs[t]``  log π_rollout(x_t) recorded by the engine at sampling time; 0.0 where
                           ``action_mask`` is 0.
- ``rewards[t]``           reward credited at token t (usually only the last action token of a
                           turn is non-zero; see DESIGN.md §1 for rewards on non-action tokens).
- ``versions[t]``          policy version that sampled token t; -1 where ``action_mask`` is 0.

``prompt_len`` is the number of leading prompt tokens (never action tokens).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class TrajectoryError(ValueError):
    """A trajectory whose per-token fields disagree with each other."""


@dataclass
class Trajectory:
    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    rewards: list[float]
    versions: list[int]
    prompt_len: int
    task_id: str = ""
    truncated: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        n = len(self.token_ids)
        for name in ("action_mask", "rollout_logprobs", "rewards", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise TrajectoryError(f"trajectory {self.task_id!r}: {name} has {got} entries, "
                                      f"token_ids has {n}")
        if not 0 <= self.prompt_len <= n:
            raise TrajectoryError(f"trajectory {self.task_id!r}: prompt_len={self.prompt_len} "
                                  f"outside [0, {n}]")
        if any(m not in (0, 1) for m in self.action_mask):
            raise TrajectoryError(f"trajectory {self.task_id!r}: action_mask must hold only 0 and 1")
        if any(self.action_mask[: self.prompt_len]):
            raise TrajectoryError(f"trajectory {self.task_id!r}: a prompt token is marked as an action")
        for t, (m, lp, v) in enumerate(zip(self.action_mask, self.rollout_logprobs, self.versions)):
            if m:
                if not (math.isfinite(lp) and lp <= 1e-6):
                    raise TrajectoryError(f"trajectory {self.task_id!r}: rollout logprob {lp} at token {t}")
                if v < 0:
                    raise TrajectoryError(f"trajectory {self.task_id!r}: action token {t} has no version")
        if any(not math.isfinite(r) for r in self.rewards):
            raise TrajectoryError(f"trajectory {self.task_id!r}: non-finite reward")

    # ------------------------------------------------------------ derived views
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def action_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.action_mask) if m]

    def staleness(self, trainer_version: int) -> int:
        """Versions between the oldest action token and the trainer's current policy."""
        vs = self.action_versions
        return trainer_version - min(vs) if vs else 0

    # -------------------------------------------------------------- round trip
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise TrajectoryError(f"unknown trajectory fields: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        # repr-exact floats: json writes the shortest string that round-trips a float64.
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))


def write_jsonl(path: str | Path, trajectories: list[Trajectory]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for tr in trajectories:
            f.write(tr.to_json() + "\n")


def read_jsonl(path: str | Path) -> list[Trajectory]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_json(line))
            except (ValueError, TypeError) as e:
                raise TrajectoryError(f"{path}:{lineno}: {e}") from e
    return out
