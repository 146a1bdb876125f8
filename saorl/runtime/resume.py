"""Where a run starts: step 0, or a resumed run's checkpoint plus the journal after it.

:func:`restore` loads the newest checkpoint (verified; an older intact one if it is damaged, per
``run.resume_fallback``: :func:`~saorl.runtime.checkpoint.resume_checkpoint`) into the learner,
then reads the journal segments after it. The result, a :class:`Start`, is what the run's feed
begins from: the rollout ids finished so far (never dispatched again) and the trajectories
finished but not trained yet (trained first, exactly once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from saorl.data.trajectory import Trajectory
from saorl.run_paths import RunPaths
from saorl.runtime.checkpoint import load_checkpoint, resume_checkpoint
from saorl.runtime.journal import Journal, RangeSet
from saorl.runtime.recorder import RunRecorder
from saorl.runtime.weights.base import WeightPublisher


@dataclass(frozen=True)
class Lineage:
    """How the policy versions of a resumed run relate to its steps, for staleness.

    A resume continues numbering above every version published before the crash
    (:func:`restore`): the versions past the checkpoint's named weights now discarded. A
    trajectory sampled before the resume (one of the journal's) counted against the new numbers
    would look ``skipped`` versions staler than it is (a run of staleness 0-2 showed 10-12 on its
    redone steps), so its staleness is counted in the run's own sequence of updates: the
    trainer's version less ``skipped``, against the version it was sampled with (never below 0:
    sampled by discarded weights further on than the redone step, it is as fresh as can be)."""

    resumed_version: int = 0
    """The first version published after the latest resume (0: never resumed)."""
    skipped: int = 0
    """Versions published before the resume past the checkpoint's (their weights discarded)."""

    def staleness(self, traj: Trajectory, trainer_version: int) -> int:
        stale = traj.staleness(trainer_version)
        versions = traj.action_versions
        if self.skipped and versions and min(versions) < self.resumed_version:
            stale = max(0, stale - self.skipped)
        return stale


@dataclass
class Start:
    """The step a run starts at, and its feed's state then."""

    step: int = 0
    finished: RangeSet = field(default_factory=RangeSet)
    """Rollout ids finished (trained, or pending below)."""
    pending: list[Trajectory] = field(default_factory=list)
    """Trajectories finished but not trained yet (each its rollout id on ``episode.rid``), in journal
    order."""
    lineage: Lineage = field(default_factory=Lineage)
    """The versions a resume skipped, for the staleness of ``pending``."""


def restore(paths: RunPaths, learner, journal: Journal, recorder: RunRecorder, weights: WeightPublisher, *,
            fallback: bool, restart: bool) -> Start:
    """The checkpoint, then the journal after it. Marks the resume in trained.jsonl and
    metrics.jsonl: the steps logged after the checkpoint are redone, so an audit must drop them
    (:func:`~saorl.runtime.recorder.effective_rows`). ``restart``: from step 0 even if training
    on record is lost."""
    log = recorder.message
    found = resume_checkpoint(paths.checkpoints, journal, fallback=fallback, log=log, restart=restart)
    start, seg, name = Start(), 0, None
    if found is not None:
        ckpt, manifest = found
        start.pending = load_checkpoint(ckpt, learner, manifest)
        start.step, name = int(manifest["step"]), ckpt.name
        start.finished = RangeSet.from_ranges(manifest["finished"])
        seg = int(manifest["journal_segment"])
    journalled = 0
    for traj in journal.read_from(seg):
        if traj.episode.rid not in start.finished:
            start.finished.add(traj.episode.rid)
            start.pending.append(traj)
            journalled += 1
    for torn in journal.torn:
        log(f"resume: dropped the torn last line of {torn} (a write the crash cut short); that rollout "
            "is sampled again")
    restarted = found is None and restart  # asked for: training on record may be lost
    if found is None:  # (else the journal redoes every step on record)
        why = "--restart: " if restarted else ""
        log(f"resume: {why}{paths.checkpoints} holds no checkpoint; the run restarts from step 0 and first "
            f"trains the {journalled} journalled trajectories")
    # one version number names one set of weights: past the checkpoint's version, the versions
    # published before the crash named weights now discarded, so continue above them
    published = weights.published_version()
    if published is not None and published > learner.version:
        start.lineage = Lineage(resumed_version=published + 1, skipped=published + 1 - learner.version)
        learner.version = published + 1
    recorder.resumed({"from_step": start.step, "checkpoint": name, "pending": len(start.pending),
                      "version": learner.version} | ({"restart": True} if restarted else {}))
    return start
