"""What crosses the transport seam between the run and its rollout workers, typed.

The run sends a :class:`RolloutRequest` per rollout; a worker answers with one of the
:data:`WorkerMessage` kinds. A backend (processes, threads in this process, Ray actors) carries
these objects as they are and gathers what arrived into a :class:`PollResult`, the one thing the
feed reads. Trajectories carry their own typed :class:`~saorl.data.trajectory.Episode` record,
which names the rollout (``episode.rid``, filled in by the worker that played it): what comes back
is a list of trajectories, never ``(rid, trajectory)`` pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from saorl.data.task import Task
from saorl.data.trajectory import Trajectory
from saorl.envs.base import Progress


@dataclass(frozen=True)
class RolloutRequest:
    rid: int
    """Rollout id (see :mod:`saorl.runtime.journal`); also the episode's sampling-seed index."""
    task: Task
    progress: Progress = field(default_factory=Progress)
    """Where training is when the rollout starts (envs whose reward moves with it read it)."""
    min_version: int = 0
    """The oldest policy version the rollout may be sampled with (the sync barrier)."""
    group: int = -1
    """The group it belongs to (its rollouts play the same task and are trained on together); the
    worker copies it onto ``episode.group``."""


@dataclass(frozen=True)
class RolloutFinished:
    worker: int
    trajectory: Trajectory
    """The finished rollout; ``trajectory.episode.rid`` is the request's rollout id."""

    @property
    def rid(self) -> int:
        return self.trajectory.episode.rid


@dataclass(frozen=True)
class RolloutFailed:
    """The episode raised (an env or engine error): the rollout is lost and will be re-queued."""

    worker: int
    rid: int
    error: str
    timed_out: bool = False
    """A call into user code ran past ``env.call_timeout_s`` (the error says which and where)."""


@dataclass(frozen=True)
class EngineStats:
    """A worker's engine counters (``InferenceEngine.stats()``), sent about once a second."""

    worker: int
    stats: dict[str, float]


@dataclass(frozen=True)
class WorkerCrashed:
    """A worker's loop died; the backend notices the dead worker and restarts it."""

    worker: int
    error: str


WorkerMessage = RolloutFinished | RolloutFailed | EngineStats | WorkerCrashed


@dataclass
class PollResult:
    """What a backend gathered in one :meth:`Backend.poll`."""

    finished: list[Trajectory] = field(default_factory=list)
    """The finished rollouts, in arrival order (each one's id is ``episode.rid``)."""
    lost: list[int] = field(default_factory=list)
    """Rollout ids whose worker died (or whose episode raised) before finishing them."""
    errors: list[str] = field(default_factory=list)
    timeouts: dict[int, str] = field(default_factory=dict)
    """The lost rollouts that ran past ``env.call_timeout_s``: rollout id → the timeout's message."""
