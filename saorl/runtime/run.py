"""The training run: rollout workers feed finished trajectories to the learner, forever.

The loop (:meth:`Run.loop`) is the whole algorithm at the systems level::

    while not done:
        batch = feed.next_batch(version)   # async: first B to finish; sync: one barriered batch
        metrics = learner.step(batch)      # K critic steps, GAE, DIS / PPO loss, one policy step
        weights.publish(policy, version)   # workers pick it up between decode steps
        record, evaluate, checkpoint

The parts come built (:mod:`saorl.runtime.parts`, assembled into a run by
:func:`saorl.runtime.assemble.build_run`, which also restores a resumed run's checkpoint); the
stages before RL (warm start, value pretraining) have run (:func:`saorl.training.train`). The
loop reads only its :class:`~saorl.runtime.settings.RunSettings`, never the config. Everything
the run writes besides checkpoints, journal and weights goes through its
:class:`~saorl.runtime.recorder.RunRecorder`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from saorl.data.trajectory import Trajectory, env_metric_means
from saorl.envs.base import Progress
from saorl.errors import RunFailure
from saorl.run_paths import RunPaths
from saorl.runtime.alarms import RunAlarms
from saorl.runtime.backends.inprocess import Stopped
from saorl.runtime.checkpoint import latest_checkpoint, oldest_journal_segment, save_checkpoint
from saorl.runtime.journal import Journal, RolloutCursor
from saorl.runtime.learner.single import Learner
from saorl.runtime.memory import MemoryWatch, format_memory
from saorl.runtime.observe import Observer
from saorl.runtime.parts import RunParts
from saorl.runtime.recorder import RunRecorder, StepClock
from saorl.runtime.resume import Start
from saorl.runtime.schedule import AsyncDispatch, RolloutFeed, SyncDispatch
from saorl.runtime.settings import RunSettings
from saorl.runtime.stopping import StopControl

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
        episodes finish; raises :class:`~saorl.runtime.backends.inprocess.Stopped` once ``should_stop()``
        is true; ``on_error`` gets the report of episodes that failed (their user code timed out)."""
        ...


class Run:
    """The loop over built parts (:func:`saorl.runtime.assemble.build_run` builds them): the
    ``learner``, the run directory's ``journal`` and ``recorder``, the backend and weights of
    ``parts``, and the loop's ``settings``; ``start`` is where a resume left off (step 0 when None)."""

    def __init__(self, settings: RunSettings, paths: RunPaths, parts: RunParts, learner: Learner,
                 journal: Journal, recorder: RunRecorder, evaluate: Evaluator, start: Start | None = None, *,
                 observer: Observer | None = None, memory: MemoryWatch | None = None) -> None:
        self.settings, self.paths, self.parts, self.evaluate = settings, paths, parts, evaluate
        self.learner, self.journal, self.recorder = learner, journal, recorder
        self.observer = observer or Observer()
        self._own_memory = memory is None
        self.memory = MemoryWatch() if memory is None else memory
        """Peak RSS per phase (the stages before, when ``saorl train`` passed its watch), into
        ``end.json`` and the console at the end (:mod:`saorl.runtime.memory`)."""
        start = start or Start()
        self.step = start.step
        self._skipped_in_a_row = 0
        self.clock = StepClock(settings.max_wall_s)
        self.feed = RolloutFeed(parts.backend, parts.train_tasks, RolloutCursor(start.finished), journal,
                                AsyncDispatch() if parts.mode == "async" else SyncDispatch(),
                                group_size=parts.preset.group_size, batch_size=settings.batch_size,
                                version=lambda: self.learner.version, progress=self._progress,
                                max_staleness=settings.max_staleness, log=recorder.message,
                                log_error=recorder.error, observer=self.observer,
                                staleness=start.lineage.staleness)
        self.feed.restore_pending(start.pending)
        self._checkpointed_step = -1  # the step this process last wrote a checkpoint of
        self._checkpointed_at = time.monotonic()  # when (reset once the workers are ready)
        self.alarms = RunAlarms(hint_lr=f"trainer.policy_lr={settings.policy_lr:g}")
        """Lines on the console the step trouble starts (:mod:`saorl.runtime.alarms`)."""
        self.stop = StopControl(settings.stop_timeout_s, recorder.message, self._kept)
        """The handler of Ctrl-C and SIGTERM (:mod:`saorl.runtime.stopping`)."""

    @property
    def _stop(self) -> bool:
        return self.stop.requested

    # ------------------------------------------------------------------- loop
    def loop(self) -> dict:
        if self._own_memory:
            self.memory.start("workers starting")
        else:
            self.memory.enter("workers starting")
        self.parts.backend.start()
        self.feed.start()
        metrics: dict = {}
        failed = True  # until the loop ends without an exception
        try:
            s = self.settings
            if self.step == 0 and s.eval_tasks and s.eval_at_start:  # step 0: what later evals compare with
                start = self._evaluate()
                if start:  # not when a stop dropped it
                    row = {"step": 0, "policy/version": self.learner.version, **start}
                    self.recorder.log_step(row)
                    for alarm in self.alarms.observe(row):
                        self.recorder.alarm(alarm.row())
            self._wait_until_ready()
            self.memory.enter("RL steps")
            self.clock.start()
            self._checkpointed_at = time.monotonic()  # run.checkpoint_every_s counts training time
            while self.step < s.steps and not self._stop:
                if self.clock.expired():
                    self.recorder.message(f"wall-clock budget of {s.max_wall_s:.0f}s reached")
                    break
                got = self.feed.next_batch(self.learner.version, lambda: self._stop)
                if got is None:
                    break
                metrics = self._train_step(*got)
            failed = False
        finally:
            self._finish(failed)
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
                                  f"that update was skipped ({self.learner.nonfinite_skips} so far)")
        self.step += 1
        if not result.frozen:  # a critic warm-up step leaves the published policy as it is
            self.learner.publish(self.parts.weights)
        metrics |= self.parts.weights.metrics()  # e.g. the server check's weights/verify_max_gap
        metrics |= self.clock.step_finished(wait_s, trajs) | self._step_metrics(trajs, version)
        for key in NOT_APPLICABLE:  # e.g. no critic in GRPO: logged as null, never as 0
            metrics.setdefault(key, math.nan)
        self.recorder.trained(self.step, trajs, train_start, train_end)
        self._periodic(metrics, trajs)
        self.recorder.log_step(metrics)
        for alarm in self.alarms.observe(metrics):
            self.recorder.alarm(alarm.row())
        self.observer.step_done(self.step, metrics, trajs)
        if self._checkpoint_due():  # after the step's rows are written: a checkpointed step is
            self.checkpoint()       # never missing one
        self._check_skips(result.skipped)  # after the step is recorded: its rollouts count as trained
        return metrics

    def _checkpoint_due(self) -> bool:
        """Every ``run.checkpoint_every`` steps, or once ``run.checkpoint_every_s`` seconds have
        passed since the last checkpoint: whichever comes first."""
        s = self.settings
        since = time.monotonic() - self._checkpointed_at
        by_time = s.checkpoint_every_s is not None and since >= s.checkpoint_every_s
        return self.step % s.checkpoint_every == 0 or by_time

    def _check_skips(self, skipped: bool) -> None:
        """Stop after ``trainer.max_nonfinite_skips`` steps in a row that skipped an update."""
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        limit = self.settings.max_nonfinite_skips
        if self._skipped_in_a_row >= limit:
            t = self.settings
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
        stale = [self.feed.staleness(t, version) for t in trajs]
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
        total = sum(s.get("decode_steps", 0) for s in stats.values()) * self.settings.engine_slots
        return {"rollout/slot_util": busy / total} if total else {}

    def _periodic(self, metrics: dict, trajs: list[Trajectory]) -> None:
        # every run.eval_every steps, and the last step (trainer.steps reached or the wall-clock
        # budget spent), so the run ends with the held-out accuracy of the policy it exports
        last = self.step >= self.settings.steps or self.clock.expired()
        if self.step % self.settings.eval_every == 0 or (last and not self._stop):
            metrics |= self._evaluate()
        if self.step % self.settings.samples_every == 0:
            self.recorder.samples(self.step, trajs)

    def _evaluate(self) -> dict:
        if not self.settings.eval_tasks:
            return {}
        t0 = time.monotonic()
        step = self.step
        try:
            with self.recorder.count(f"eval step {step}") as count, self.memory.phase("evaluation"):
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
        path = save_checkpoint(self.paths.checkpoints, self.step, self.learner,
                               {"finished": finished, "journal_segment": seg},
                               pending, keep=self.settings.keep_checkpoints)
        # keep the journal back to the oldest kept checkpoint, so a resume can fall back to it
        oldest = oldest_journal_segment(self.paths.checkpoints)
        self.journal.prune_before(seg if oldest is None else oldest)
        self._checkpointed_step, self._checkpointed_at = self.step, time.monotonic()
        return path

    def request_stop(self, signum: int | None = None, frame: object = None) -> None:
        """Ctrl-C / SIGTERM: stop after this step, in bounded time (:mod:`saorl.runtime.stopping`)."""
        self.stop(signum, frame)

    def _kept(self) -> str:
        """What a forced stop leaves behind, for its message."""
        latest = latest_checkpoint(self.paths.checkpoints)
        if latest is None:
            return "no checkpoint was written yet (a resume starts at step 0 with the journalled rollouts)"
        return (f"the last checkpoint, {latest}, is intact: saorl train --resume {self.paths.root} continues "
                "from it")

    def _finish(self, failed: bool = False) -> None:
        """Final checkpoint and policy, then everything closed and ``end.json`` written; ``failed``:
        an exception ends the run (as one raised here does), whatever its steps or budget say."""
        self.feed.stop()  # nothing arrives after this: the final checkpoint is consistent
        self.memory.enter("final checkpoint and shutdown")
        try:
            # a step checkpointed already is not written again: rewriting its directory would leave a
            # moment without it, and what arrived since is in the journal, which a resume reads
            if self.step > 0 and self.step != self._checkpointed_step:
                self.checkpoint()
            if self.step > 0:
                self.recorder.export_final(*self.learner.full_models())
        except BaseException:
            failed = True
            raise
        finally:
            try:
                self.parts.backend.shutdown()
            finally:  # the journal and the trackers close even if the shutdown fails
                try:
                    self.parts.weights.close()
                finally:
                    self.journal.close()
                    self._ended(failed)
                    self._stability()
                    self._plot()
                    self.recorder.close()
                    self.observer.run_finished()

    def _ended(self, failed: bool) -> None:
        """``end.json``; a failure to write it (a full disk) never replaces the run's own outcome."""
        why = "failed" if failed else self._why()
        memory = self.memory.stop() if self._own_memory else self.memory.report()
        if memory["phases"]:
            self.recorder.message(format_memory(memory))
        try:
            self.recorder.ended({"step": self.step, "steps": self.settings.steps, "why": why,
                                 "memory": memory})
        except OSError as e:
            self.recorder.message(f"end.json not written: {type(e).__name__}: {e}")

    def _why(self) -> str:
        """Why a run that no exception ends ends: ``done`` (its steps), ``budget`` (trainer.max_wall_s),
        ``stopped`` (Ctrl-C, SIGTERM) or ``failed`` (``_finish`` says ``failed`` first when one does)."""
        if self.step >= self.settings.steps:
            return "done"
        if self.clock.expired():
            return "budget"
        return "stopped" if self._stop else "failed"

    def _plot(self) -> None:
        """The run's picture into ``run.png`` (:mod:`saorl.runtime.run_plot`); a failure here
        never fails the run."""
        if self.step == 0:
            return
        from saorl.runtime.run_plot import plot_run

        try:
            self.recorder.message(f"plot of the run: {plot_run(self.paths.root)}")
        except Exception as e:  # a picture of files on disk: the run itself is done
            self.recorder.message(f"run.png not drawn: {type(e).__name__}: {e}")

    def _stability(self) -> None:
        """The run's stability signals into ``stability.json``, one line on the console
        (:mod:`saorl.runtime.run_signals`); a failure here never fails the run."""
        from saorl.runtime.run_signals import summary_line, write_run_stability

        try:
            self.recorder.message(summary_line(write_run_stability(self.paths.root)))
        except Exception as e:  # a summary of files on disk: the run itself is done
            self.recorder.message(f"stability.json not written: {type(e).__name__}: {e}")


def _p90(values: list[int]) -> float:
    """The 90th percentile (linear between the two nearest ranks; one value: itself)."""
    xs = sorted(values)
    pos = 0.9 * (len(xs) - 1)
    lo = int(pos)
    return float(xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo))
