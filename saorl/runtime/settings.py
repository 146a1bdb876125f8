"""What the run loop reads of the config, and nothing else: a small frozen record.

:class:`~saorl.runtime.run.Run` never sees the config tree; :func:`RunSettings.from_config`
unpacks it once, where the run is assembled (:func:`saorl.runtime.assemble.build_run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saorl.config import SaorlConfig


@dataclass(frozen=True)
class RunSettings:
    steps: int
    """Trainer steps to reach (``trainer.steps``)."""
    batch_size: int
    """Trajectories per step (``trainer.batch_size``)."""
    max_staleness: int | None
    """Groups staler than this many versions are dropped (``trainer.max_staleness``)."""
    max_wall_s: float | None
    """The wall-clock budget, from the moment every worker is ready (``trainer.max_wall_s``)."""
    stop_timeout_s: float
    """How long a stop may take before the process ends at once (``trainer.stop_timeout_s``)."""
    max_nonfinite_skips: int
    """Skipped updates in a row that stop the run (``trainer.max_nonfinite_skips``)."""
    policy_lr: float
    critic_lr: float
    """The learning rates, named in the message of a run stopped by non-finite updates."""
    eval_every: int
    eval_tasks: int
    eval_at_start: bool
    """Evaluation cadence, test episodes per evaluation (0: none), and the step-0 evaluation."""
    samples_every: int
    """Steps between the decoded samples written to ``samples/``."""
    checkpoint_every: int
    checkpoint_every_s: float | None
    keep_checkpoints: int
    """Checkpoint cadence, by steps and by seconds (either one writes a checkpoint; None: by steps
    only), and how many checkpoints are kept."""
    resume_fallback: bool
    """A resume may fall back to an older intact checkpoint (``run.resume_fallback``)."""
    progress: bool
    """The live progress line (``run.progress``)."""
    engine_slots: int
    """Decode slots per local engine, the denominator of ``rollout/slot_util``."""

    @classmethod
    def from_config(cls, cfg: SaorlConfig) -> RunSettings:
        t, r = cfg.trainer, cfg.run
        return cls(steps=t.steps, batch_size=t.batch_size, max_staleness=t.max_staleness,
                   max_wall_s=t.max_wall_s, stop_timeout_s=t.stop_timeout_s,
                   max_nonfinite_skips=t.max_nonfinite_skips, policy_lr=t.policy_lr, critic_lr=t.critic_lr,
                   eval_every=r.eval_every, eval_tasks=r.eval_tasks, eval_at_start=r.eval_at_start,
                   samples_every=r.samples_every, checkpoint_every=r.checkpoint_every,
                   checkpoint_every_s=r.checkpoint_every_s,
                   keep_checkpoints=r.keep_checkpoints, resume_fallback=r.resume_fallback,
                   progress=r.progress, engine_slots=cfg.rollout.local_engine.slots)
