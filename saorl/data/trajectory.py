"""The one typed record that flows from rollout workers to the trainer.

A trajectory is a flat token sequence: the prompt, then the response, which interleaves
*action* tokens (sampled by the policy) and *observation* tokens (written by the environment).
Every per-token list has the same length as ``token_ids``:

- ``action_mask[t]``       1 for tokens the policy sampled, 0 for prompt / observation tokens.
- ``rollout_logprobs[t]``  log π_rollout(x_t) recorded by the engine at sampling time; 0.0 where
                           ``action_mask`` is 0.
- ``rewards[t]``           reward credited at token t (usually only the last action token of a
                           turn is non-zero; see docs/method.md for rewards on non-action tokens).
- ``versions[t]``          policy version that sampled token t; -1 where ``action_mask`` is 0.

``prompt_len`` is the number of leading prompt tokens (never action tokens). What the episode
was beside its tokens (turns, success, timing, which rollout and worker) is the typed
:class:`Episode` record; ``metadata`` holds only free-form extras nothing in saorl relies on.

**Segments.** An episode is one token sequence when every turn's context extends the previous
one's. An agent program that owns its conversation (``openai_agent``) may cut, summarise or rewrite
its history between calls; its episode is then several sequences that share the episode's reward.
The trajectory's own tokens are the last of them; the others are its ``segments``
(:class:`Segment`: the same per-token fields), carried inside the one trajectory so that one
request still gives one trajectory through the workers, the journal and a resume.
:func:`training_rows` expands them where a learner builds its batch: each segment one row, its own
GAE chain, the episode's reward on its own last action token (the producer puts it there).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, replace
from typing import Any


class TrajectoryError(ValueError):
    """A trajectory whose per-token fields disagree with each other."""


@dataclass
class Episode:
    """The facts of one episode that the trainer, evaluation and benchmarks read."""

    env: str = ""
    """The env's name."""
    turns: int = 0
    """Action turns played."""
    success: bool = False
    """The env's final ``info["success"]`` (what evaluation accuracy counts)."""
    final_reward: float = 0.0
    """Reward of the last turn."""
    turn_rewards: list[float] = field(default_factory=list)
    turn_spans: list[list[int]] = field(default_factory=list)
    """``[start, end)`` token positions of each turn's action."""
    finish_reasons: list[str] = field(default_factory=list)
    """The engine's finish reason per turn (``stop`` / ``length``)."""
    final_observation: str = ""
    """The env's last message, never tokenized (nothing is sampled after it)."""
    truncation: str | None = None
    """``"turns"`` or ``"tokens"`` when a limit ended the episode rather than the env."""
    gen_seconds: float = 0.0
    env_seconds: float = 0.0
    env_metrics: dict[str, float] = field(default_factory=dict)
    """The env's own numbers about the episode (its final ``info["metrics"]``, e.g. which style a
    ``style_shift`` line matched); runs log their batch means as ``env/<key>``."""
    rid: int = -1
    """Rollout id (``-1`` outside a training run)."""
    group: int = -1
    """The group of rollouts of one task that an update takes together (GRPO's group; with SAO's
    groups of one, its own), given by the trainer with the request; ``-1`` outside a training run."""
    worker: int | None = None
    """Rollout worker that played it."""
    t_start: float | None = None
    """Wall-clock start and end (seconds since the epoch) in the worker."""
    t_end: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise TrajectoryError(f"unknown episode fields: {sorted(unknown)}")
        return cls(**d)


def env_metric_means(trajs: list[Trajectory], prefix: str = "env/") -> dict[str, float]:
    """``prefix + key`` → mean of ``episode.env_metrics[key]`` over the trajectories that report it."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in t.episode.env_metrics.items():
            values.setdefault(k, []).append(float(v))
    return {prefix + k: sum(v) / len(v) for k, v in sorted(values.items())}


def _check_tokens(where: str, token_ids: list[int], action_mask: list[int], rollout_logprobs: list[float],
                  rewards: list[float], versions: list[int], prompt_len: int) -> None:
    """The per-token fields of a trajectory or a segment agree with each other (module docstring)."""
    n = len(token_ids)
    for name, got in (("action_mask", action_mask), ("rollout_logprobs", rollout_logprobs),
                      ("rewards", rewards), ("versions", versions)):
        if len(got) != n:
            raise TrajectoryError(f"{where}: {name} has {len(got)} entries, token_ids has {n}")
    if not 0 <= prompt_len <= n:
        raise TrajectoryError(f"{where}: prompt_len={prompt_len} outside [0, {n}]")
    if any(m not in (0, 1) for m in action_mask):
        raise TrajectoryError(f"{where}: action_mask must hold only 0 and 1")
    if any(action_mask[:prompt_len]):
        raise TrajectoryError(f"{where}: a prompt token is marked as an action")
    for t, (m, lp, v) in enumerate(zip(action_mask, rollout_logprobs, versions)):
        if m:
            if not (math.isfinite(lp) and lp <= 1e-6):
                raise TrajectoryError(f"{where}: rollout logprob {lp} at token {t}")
            if v < 0:
                raise TrajectoryError(f"{where}: action token {t} has no version")
    if any(not math.isfinite(r) for r in rewards):
        raise TrajectoryError(f"{where}: non-finite reward")


@dataclass
class Segment:
    """An earlier token sequence of an episode whose agent rewrote its history (module docstring):
    the per-token fields of a :class:`Trajectory`, with the same meaning."""

    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    rewards: list[float]
    versions: list[int]
    prompt_len: int


def _segment(value: Segment | dict[str, Any], task_id: str) -> Segment:
    if isinstance(value, Segment):
        return value
    names = set(Segment.__dataclass_fields__)
    if not isinstance(value, dict) or set(value) != names:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise TrajectoryError(f"trajectory {task_id!r}: a segment must hold exactly {sorted(names)}, "
                              f"got {got}")
    return Segment(**value)


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
    episode: Episode = field(default_factory=Episode)
    metadata: dict[str, Any] = field(default_factory=dict)
    routes: list[list[int]] | None = None
    """MoE routing the engine used (routing replay): per token, the experts of every MoE layer
    flattened ``layers × k``, ``-1`` where the engine never fed that token to the model (the last
    sampled one); None when the engine recorded none."""
    segments: list[Segment] = field(default_factory=list)
    """The episode's earlier token sequences, when its agent rewrote its history (module docstring);
    empty for an episode that is one sequence."""

    def __post_init__(self) -> None:
        if isinstance(self.episode, dict):
            self.episode = Episode.from_dict(self.episode)
        self.segments = [_segment(s, self.task_id) for s in self.segments]
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        where = f"trajectory {self.task_id!r}"
        _check_tokens(where, self.token_ids, self.action_mask, self.rollout_logprobs, self.rewards,
                      self.versions, self.prompt_len)
        for i, seg in enumerate(self.segments):
            _check_tokens(f"{where} segment {i}", seg.token_ids, seg.action_mask, seg.rollout_logprobs,
                          seg.rewards, seg.versions, seg.prompt_len)
        n = len(self.token_ids)
        if self.routes is not None:
            widths = {len(r) for r in self.routes}
            if len(self.routes) != n or len(widths) != 1 or not widths.pop():
                raise TrajectoryError(f"trajectory {self.task_id!r}: routes must give one non-empty row of "
                                      f"the same width per token ({n}), got {len(self.routes)} rows")

    # ------------------------------------------------------------ derived views
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def cut_short(self) -> bool:
        """The episode ended by a limit (``truncated``: turns or tokens), or its last action was cut
        at its token limit (``finish_reason`` ``"length"``: ``rollout.max_new_tokens`` or the tokens
        left) though the env then ended the episode."""
        reasons = self.episode.finish_reasons
        return self.truncated or bool(reasons and reasons[-1] == "length")

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
        """The inverse of :meth:`to_dict`; ``TrajectoryError`` on a record of another shape."""
        if not isinstance(d, dict):
            raise TrajectoryError(f"a trajectory record must be a JSON object, got {type(d).__name__}")
        fields = cls.__dataclass_fields__
        unknown = set(d) - set(fields)
        if unknown:
            raise TrajectoryError(f"unknown trajectory fields: {sorted(unknown)}")
        required = {n for n, f in fields.items() if f.default is MISSING and f.default_factory is MISSING}
        missing = required - set(d)
        if missing:
            raise TrajectoryError(f"missing trajectory fields: {sorted(missing)}")
        return cls(**d)

    def to_json(self) -> str:
        # repr-exact floats: json writes the shortest string that round-trips a float64.
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))


def training_rows(trajs: list[Trajectory], group_ids: list[int]) -> tuple[list[Trajectory], list[int]]:
    """The rows a learner trains on: each trajectory's :attr:`~Trajectory.segments` as rows of their
    own (before it, same episode, same group id), then the trajectory itself without them."""
    if not any(t.segments for t in trajs):
        return trajs, group_ids
    rows: list[Trajectory] = []
    gids: list[int] = []
    for traj, gid in zip(trajs, group_ids):
        for seg in traj.segments:
            rows.append(Trajectory(seg.token_ids, seg.action_mask, seg.rollout_logprobs, seg.rewards,
                                   seg.versions, seg.prompt_len, task_id=traj.task_id,
                                   truncated=traj.truncated, episode=traj.episode))
            gids.append(gid)
        rows.append(replace(traj, segments=[]))
        gids.append(gid)
    return rows, gids
