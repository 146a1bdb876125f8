"""The training run: rollout workers feed finished trajectories to the learner, forever.

The loop (:meth:`Run.loop`) is the whole algorithm at the systems level::

    while not done:
        batch = feed.next_batch(version)   # async: first B to finish; sync: one barriered batch
        metrics = learner.step(batch)      # K critic steps, GAE, DIS / PPO loss, one policy step
        weights.publish(policy, version)   # workers pick it up between decode steps
        record, evaluate, checkpoint

The parts come built (:mod:`saorl.runtime.parts`); the stages before RL (warm start, value
pretraining) have run (:func:`saorl.training.train`). Everything the run writes besides
checkpoints, journal and weights goes through its :class:`~saorl.runtime.recorder.RunRecorder`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from saorl.config import SaorlConfig, config_to_dict, save_resolved
from saorl.data.trajectory import Trajectory, env_metric_means
from saorl.envs.base import Progress
from saorl.errors import RunFailure
from saorl.runtime.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    oldest_journal_segment,
    resume_checkpoint,
    save_checkpoint,
)
from saorl.runtime.inprocess import Stopped
from saorl.runtime.journal import Journal, RangeSet, RolloutCursor
from saorl.runtime.observe import Observer
from saorl.runtime.parts import RunParts, build_learner
from saorl.runtime.recorder import RunRecorder, StepClock
from saorl.runtime.rundir import remove_temporaries
from saorl.runtime.schedule import AsyncDispatch, RolloutFeed, SyncDispatch
from saorl.runtime.stopping import StopControl
from saorl.runtime.trackers import Trackers

# Required metrics that an algorithm may not produce (GRPO has no critic, PPO no DIS mask).
NOT_APPLICABLE = ("policy/dis_kept_frac", "critic/value_loss", "critic/explained_var")


class NonFiniteError(RunFailure):
    """Too many consecutive updates were skipped as non-finite (exit 3); one paragraph."""


class Evaluator(Protocol):
    def __call__(self, policy: torch.nn.Module, progress: Progress,
                 on_done: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 on_error: Callable[[str], None] | None = None) -> dict[str, float]:
        """``eval/*`` metrics of ``policy`` on the run's test split; ``on_done(done, total)`` as
        episodes finish; raises :class:`~saorl.runtime.inprocess.Stopped` once ``should_stop()``
        is true; ``on_error`` gets the report of episodes that failed (their user code timed out)."""
        ...


class Run:
    def __init__(self, cfg: SaorlConfig, run_dir: Path, parts: RunParts, evaluate: Evaluator, *,
                 resume: bool = False, restart: bool = False, observer: Observer | None = None) -> None:
        self.cfg, self.dir, self.parts, self.evaluate = cfg, run_dir, parts, evaluate
        self.restart = restart  # with resume: from step 0 even if training on record is lost
        self.observer = observer or Observer()
        self.learner = build_learner(cfg, parts.policy, parts.critic, parts.tokenizer.pad_token_id)
        self.journal = Journal(run_dir / "journal")
        self.recorder = RunRecorder(run_dir, parts.tokenizer, progress=cfg.run.progress,
                                    total_steps=cfg.trainer.steps)
        self.step = 0
        self._skipped_in_a_row = 0
        finished, pending = RangeSet(), []
        try:
            removed = remove_temporaries(run_dir)  # train() holds the run directory's lock
            if removed:
                self.recorder.message(f"removed what a crash left half-written: {', '.join(removed)}")
            if resume:
                finished, pending = self._restore()
            save_resolved(cfg, run_dir)  # on resume: the config now in force, overrides included
            self.learner.publish(parts.weights)
        except BaseException:
            parts.weights.close()
            self.journal.close()
            self.recorder.close()
            raise
        self.clock = StepClock(cfg.trainer.max_wall_s)
        self.feed = RolloutFeed(parts.backend, parts.train_tasks, RolloutCursor(finished), self.journal,
                                AsyncDispatch() if parts.mode == "async" else SyncDispatch(),
                                group_size=parts.preset.group_size, batch_size=cfg.trainer.batch_size,
                                version=lambda: self.learner.version, progress=self._progress,
                                max_staleness=cfg.trainer.max_staleness, log=self.recorder.message,
                                log_error=self.recorder.error, observer=self.observer)
        self.feed.restore_pending(pending)
        self._checkpointed_step = -1  # the step this process last wrote a checkpoint of
        self.stop = StopControl(cfg.trainer.stop_timeout_s, self.recorder.message, self._kept)
        """The handler of Ctrl-C and SIGTERM (:mod:`saorl.runtime.stopping`)."""
        try:  # last: a start that fails before this has no tracker files for its clean-up to remove
            self.recorder.trackers = Trackers(cfg.run.report_to, run_dir, project=cfg.run.tracker_project,
                                              options=cfg.run.tracker_options, config=config_to_dict(cfg))
        except BaseException:
            parts.weights.close()
            self.journal.close()
            self.recorder.close()
            raise

    @property
    def _stop(self) -> bool:
        return self.stop.requested

    # ----------------------------------------------------------------- resume
    def _restore(self) -> tuple[RangeSet, list]:
        """The checkpoint (verified; an older intact one if it is damaged), then the journal after
        it. Marks the resume in trained.jsonl and metrics.jsonl: the steps logged after the
        checkpoint are redone, so an audit must drop them (:func:`~saorl.runtime.recorder.effective_rows`)."""
        found = resume_checkpoint(self.dir / "checkpoints", self.journal,
                                  fallback=self.cfg.run.resume_fallback, log=self.recorder.message,
                                  restart=self.restart)
        finished, pending, seg, name = RangeSet(), [], 0, None
        if found is not None:
            ckpt, manifest = found
            pending = load_checkpoint(ckpt, self.learner, manifest)
            self.step, name = int(manifest["step"]), ckpt.name
            finished = RangeSet.from_ranges(manifest["finished"])
            seg = int(manifest["journal_segment"])
        journalled = 0
        for rid, traj in self.journal.read_from(seg):
            if rid not in finished:
                finished.add(rid)
                pending.append((rid, traj))
                journalled += 1
        for torn in self.journal.torn:
            self.recorder.message(f"resume: dropped the torn last line of {torn} (a write the crash cut "
                                  "short); that rollout is sampled again")
        restarted = found is None and self.restart  # asked for: training on record may be lost
        if found is None:  # (else the journal redoes every step on record)
            why = "--restart: " if restarted else ""
            self.recorder.message(f"resume: {why}{self.dir / 'checkpoints'} holds no checkpoint; the run "
                                  f"restarts from step 0 and first trains the {journalled} journalled "
                                  "trajectories")
        # one version number names one set of weights: past the checkpoint's version, the versions
        # published before the crash named weights now discarded, so continue above them
        published = self.parts.weights.published_version()
        if published is not None and published > self.learner.version:
            self.learner.version = published + 1
        self.recorder.resumed({"from_step": self.step, "checkpoint": name, "pending": len(pending),
                               "version": self.learner.version} | ({"restart": True} if restarted else {}))
        return finished, pending

    # ------------------------------------------------------------------- loop
    def loop(self) -> dict:
        self.parts.backend.start()
        self.feed.start()
        metrics: dict = {}
        try:
            run = self.cfg.run  # step 0: what every later evaluation is compared with
            if self.step == 0 and run.eval_tasks and run.eval_at_start:
                start = self._evaluate()
                if start:  # not when a stop dropped it
                    self.recorder.message(f"step 0 eval: accuracy {start.get('eval/accuracy', math.nan):.3f}")
                    self.recorder.log_step({"step": 0, "policy/version": self.learner.version, **start})
            self._wait_until_ready()
            self.clock.start()
            while self.step < self.cfg.trainer.steps and not self._stop:
                if self.clock.expired():
                    self.recorder.message(f"wall-clock budget of {self.cfg.trainer.max_wall_s:.0f}s reached")
                    break
                got = self.feed.next_batch(self.learner.version, lambda: self._stop)
                if got is None:
                    break
                metrics = self._train_step(*got)
        finally:
            self._finish()
        return metrics

    def _wait_until_ready(self) -> None:
        """Until every rollout worker has built its engine: the budget measures training."""
        while not self.parts.backend.ready() and not self._stop:
            self.feed.raise_if_failed()
            time.sleep(0.05)

    def _train_step(self, trajs: list[Trajectory], gids: list[int], wait_s: float) -> dict:
        version = self.learner.version
        self.clock.train_started()
        result = self.learner.step(trajs, gids)
        metrics = dict(result)
        train_start, train_end = self.clock.train_interval()
        if result.skipped:
            self.recorder.message(f"step {self.step + 1}: a non-finite loss, gradient or updated weight; "
                                  f"that update was rolled back ({self.learner.nonfinite_skips} so far)")
        self.step += 1
        self.learner.publish(self.parts.weights)
        metrics |= self.parts.weights.metrics()  # e.g. the server check's weights/verify_max_gap
        metrics |= self.clock.step_finished(wait_s, trajs) | self._step_metrics(trajs, version)
        for key in NOT_APPLICABLE:  # e.g. no critic in GRPO: logged as null, never as 0
            metrics.setdefault(key, math.nan)
        self.recorder.trained(self.step, trajs, train_start, train_end)
        self._periodic(metrics, trajs)
        self.recorder.log_step(metrics)
        self.observer.step_done(self.step, metrics, trajs)
        if self.step % self.cfg.run.checkpoint_every == 0:  # after the step's rows are written: a
            self.checkpoint()                               # checkpointed step is never missing one
        self._check_skips(result.skipped)  # after the step is recorded: its rollouts count as trained
        return metrics

    def _check_skips(self, skipped: bool) -> None:
        """Stop after ``trainer.max_nonfinite_skips`` steps in a row that skipped an update."""
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        limit = self.cfg.trainer.max_nonfinite_skips
        if self._skipped_in_a_row >= limit:
            t = self.cfg.trainer
            raise NonFiniteError(
                f"training stopped at step {self.step}: the last {limit} steps in a row skipped their "
                "update because a loss, a gradient or the updated weights were not finite (inf or NaN), "
                f"so the run was no longer learning (trainer.max_nonfinite_skips={limit}). No non-finite "
                "weight was kept: the checkpoint and final/ hold the last finite weights. The usual "
                f"cause is a learning rate too large for the model (trainer.policy_lr={t.policy_lr:g}, "
                f"trainer.critic_lr={t.critic_lr:g}); lower it, or check the env's rewards for huge "
                "values, then start a new run (or resume this one with the new setting).")

    def _progress(self) -> Progress:
        return Progress(trainer_step=self.step, episode=self.feed.stats.finished)

    def _step_metrics(self, trajs: list[Trajectory], version: int) -> dict:
        stale = [t.staleness(version) for t in trajs]
        versions = {v for t in trajs for v in t.action_versions}
        s = self.feed.stats
        m = {
            "step": self.step,
            "reward/mean": statistics.fmean(t.total_reward for t in trajs),
            "reward/std": statistics.pstdev(t.total_reward for t in trajs),
            "reward/success_frac": statistics.fmean(float(t.episode.success) for t in trajs),
            "rollout/staleness_mean": statistics.fmean(stale), "rollout/staleness_max": max(stale),
            "rollout/versions_in_batch": len(versions),
            "rollout/action_tokens_mean": statistics.fmean(t.num_action_tokens for t in trajs),
            "rollout/action_tokens_p90": _p90([t.num_action_tokens for t in trajs]),
            "rollout/truncated_frac": statistics.fmean(float(t.cut_short) for t in trajs),
            "rollout/dropped_stale": s.dropped_stale, "rollout/requeued": s.requeued,
            "rollout/finished": s.finished, "rollout/trained": len(trajs),
            "rollout/worker_restarts": self.parts.backend.restarts,
        }
        return m | env_metric_means(trajs) | self._slot_utilisation()

    def _slot_utilisation(self) -> dict:
        """Busy decode slots over all slots of the decode steps run so far (all workers)."""
        stats = self.parts.backend.engine_stats()
        busy = sum(s.get("busy_slot_steps", 0) for s in stats.values())
        total = sum(s.get("decode_steps", 0) for s in stats.values()) * self.cfg.rollout.local_engine.slots
        return {"rollout/slot_util": busy / total} if total else {}

    def _periodic(self, metrics: dict, trajs: list[Trajectory]) -> None:
        run = self.cfg.run
        if self.step % run.eval_every == 0:
            metrics |= self._evaluate()
        if self.step % run.samples_every == 0:
            self.recorder.samples(self.step, trajs)

    def _evaluate(self) -> dict:
        if not self.cfg.run.eval_tasks:
            return {}
        t0 = time.monotonic()
        step = self.step
        try:
            with self.recorder.count(f"eval step {step}") as count:
                m = self.evaluate(self.learner.full_models()[0], self._progress(), count,
                                  should_stop=lambda: self._stop,
                                  on_error=lambda text: self.recorder.error(f"eval step {step}: {text}"))
        except Stopped:
            self.recorder.message(f"eval step {step}: dropped, the run is stopping")
            return {}
        m["time/eval_s"] = time.monotonic() - t0
        self.recorder.log_eval(self.step, self.learner.version, m)
        return m

    def checkpoint(self) -> Path:
        finished, pending, seg = self.feed.checkpoint_state()
        path = save_checkpoint(self.dir / "checkpoints", self.step, self.learner,
                               {"finished": finished, "journal_segment": seg},
                               pending, keep=self.cfg.run.keep_checkpoints)
        # keep the journal back to the oldest kept checkpoint, so a resume can fall back to it
        oldest = oldest_journal_segment(self.dir / "checkpoints")
        self.journal.prune_before(seg if oldest is None else oldest)
        self._checkpointed_step = self.step
        return path

    def request_stop(self, signum: int | None = None, frame: object = None) -> None:
        """Ctrl-C / SIGTERM: stop after this step, in bounded time (:mod:`saorl.runtime.stopping`)."""
        self.stop(signum, frame)

    def _kept(self) -> str:
        """What a forced stop leaves behind, for its message."""
        latest = latest_checkpoint(self.dir / "checkpoints")
        if latest is None:
            return "no checkpoint was written yet (a resume starts at step 0 with the journalled rollouts)"
        return (f"the last checkpoint, {latest}, is intact: saorl train --resume {self.dir} continues "
                "from it")

    def _finish(self) -> None:
        self.feed.stop()  # nothing arrives after this: the final checkpoint is consistent
        try:
            # a step checkpointed already is not written again: rewriting its directory would leave a
            # moment without it, and what arrived since is in the journal, which a resume reads
            if self.step > 0 and self.step != self._checkpointed_step:
                self.checkpoint()
            if self.step > 0:
                self.recorder.export_final(*self.learner.full_models())
        finally:
            try:
                self.parts.backend.shutdown()
            finally:  # the journal and the trackers close even if the shutdown fails
                try:
                    self.parts.weights.close()
                finally:
                    self.journal.close()
                    self._stability()
                    self.recorder.close()
                    self.observer.run_finished()

    def _stability(self) -> None:
        """The run's stability signals into ``stability.json``, one line on the console
        (:mod:`saorl.runtime.run_signals`); a failure here never fails the run."""
        from saorl.runtime.run_signals import summary_line, write_run_stability

        try:
            self.recorder.message(summary_line(write_run_stability(self.dir)))
        except Exception as e:  # a summary of files on disk: the run itself is done
            self.recorder.message(f"stability.json not written: {type(e).__name__}: {e}")


def _p90(values: list[int]) -> float:
    """The 90th percentile (linear between the two nearest ranks; one value: itself)."""
    xs = sorted(values)
    pos = 0.9 * (len(xs) - 1)
    lo = int(pos)
    return float(xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo))
