"""The training run: rollout workers feed finished trajectories to the learner, forever.

The top-level loop (:meth:`Run.loop`) is the whole algorithm at the systems level::

    while not done:
        batch = feed.next_batch(version)   # async: first B to finish; sync: one barriered batch
        metrics = learner.step(batch)      # K critic steps, GAE, DIS / PPO loss, one policy step
        weights.publish(policy, version)   # workers pick it up between decode steps
        log, evaluate, checkpoint

Everything else here is set-up (run directory, models, env, backend) and bookkeeping
(metrics, samples, checkpoints, Ctrl-C, resume).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

from saorl.config import SaorlConfig, save_resolved
from saorl.envs.base import Progress
from saorl.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from saorl.runtime.journal import Journal, RangeSet, RolloutCursor
from saorl.runtime.learner import Learner, OptimConfig
from saorl.runtime.metrics import MetricsLogger
from saorl.runtime.schedule import AsyncDispatch, RolloutFeed, SyncDispatch
from saorl.runtime.setup import RunParts, build_parts
from saorl.runtime.value_pretrain import initial_critic
from saorl.runtime.warmstart import initial_policy
from saorl.runtime.weights import FileWeightSync

# Required metrics that an algorithm may not produce (GRPO has no critic, PPO no DIS mask).
NOT_APPLICABLE = ("policy/dis_kept_frac", "critic/value_loss", "critic/explained_var")


def new_run_dir(cfg: SaorlConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    d = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    n = 1
    while d.exists():
        d = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}-{n}"
        n += 1
    d.mkdir(parents=True)
    return d


class Run:
    def __init__(self, cfg: SaorlConfig, run_dir: Path, *, resume: bool = False) -> None:
        self.cfg, self.dir = cfg, run_dir
        policy_spec = initial_policy(cfg)
        self.parts: RunParts = build_parts(cfg, run_dir, policy_spec, initial_critic(cfg, policy_spec))
        p = self.parts
        self.preset = p.preset
        self.learner = Learner(p.policy, p.critic, p.preset,
                               OptimConfig(cfg.trainer.policy_lr, cfg.trainer.critic_lr,
                                           cfg.trainer.weight_decay, cfg.trainer.grad_clip,
                                           cfg.trainer.warmup_steps),
                               pad_id=p.tokenizer.pad_token_id, temperature=cfg.rollout.temperature,
                               device=cfg.model.device)
        self.journal = Journal(run_dir / "journal")
        self.weights = FileWeightSync(run_dir / "weights")
        self.step = 0
        finished, pending = RangeSet(), []
        if resume:
            finished, pending = self._restore()
        save_resolved(cfg, run_dir)  # on resume: the config now in force, overrides included
        self.weights.publish(self.learner.policy_state(), self.learner.version)
        self.logger = MetricsLogger(run_dir, progress=cfg.run.progress, total_steps=cfg.trainer.steps)
        self.feed = RolloutFeed(p.backend, p.train_tasks, RolloutCursor(finished), self.journal,
                                AsyncDispatch() if p.mode == "async" else SyncDispatch(),
                                group_size=p.preset.group_size, batch_size=cfg.trainer.batch_size,
                                version=lambda: self.learner.version, progress=self._progress,
                                max_staleness=cfg.trainer.max_staleness, log=self.logger.message)
        self.feed.restore_pending(pending)
        self._stop = False
        self._trained_log = open(run_dir / "trained.jsonl", "a", encoding="utf-8")

    # ----------------------------------------------------------------- resume
    def _restore(self) -> tuple[RangeSet, list]:
        ckpt = latest_checkpoint(self.dir / "checkpoints")
        finished, pending, seg = RangeSet(), [], 0
        if ckpt is not None:
            manifest, pending = load_checkpoint(ckpt, self.learner)
            self.step = int(manifest["step"])
            finished = RangeSet.from_ranges(manifest["finished"])
            seg = int(manifest["journal_segment"])
        for rid, traj in self.journal.read_from(seg):
            if rid not in finished:
                finished.add(rid)
                pending.append((rid, traj))
        return finished, pending

    # ------------------------------------------------------------------- loop
    def loop(self) -> dict:
        cfg, p = self.cfg, self.parts
        p.backend.start()
        self.feed.start()
        if self.step == 0 and cfg.run.eval_every:
            start = self._evaluate()  # the starting point every later evaluation is compared with
            self.logger.message(f"step 0 eval: accuracy {start.get('eval/accuracy', float('nan')):.3f}")
        t_start, last = time.monotonic(), time.monotonic()
        deadline = t_start + cfg.trainer.max_wall_s if cfg.trainer.max_wall_s else None
        metrics: dict = {}
        try:
            while self.step < cfg.trainer.steps and not self._stop:
                if deadline and time.monotonic() > deadline:
                    self.logger.message(f"wall-clock budget of {cfg.trainer.max_wall_s:.0f}s reached")
                    break
                got = self.feed.next_batch(self.learner.version, lambda: self._stop)
                if got is None:
                    break
                trajs, gids, wait_s = got
                t_train, version, wall0 = time.monotonic(), self.learner.version, time.time()
                skips = self.learner.nonfinite_skips
                metrics = self.learner.step(trajs, gids)
                wall1 = time.time()
                if self.learner.nonfinite_skips > skips:
                    self.logger.message(f"step {self.step + 1}: non-finite loss or gradient, update skipped "
                                  f"({self.learner.nonfinite_skips} so far); the weights are unchanged")
                self.step += 1
                self.weights.publish(self.learner.policy_state(), self.learner.version)
                now = time.monotonic()
                metrics |= self._step_metrics(trajs, version, wait_s, now - t_train,
                                              now - last, now - t_start)
                for key in NOT_APPLICABLE:  # e.g. no critic in GRPO: logged as null, never as 0
                    metrics.setdefault(key, math.nan)
                last = now
                self._record_trained(trajs, (wall0, wall1))
                self._periodic(metrics, trajs)
                self.logger.log(metrics)
        finally:
            self._finish()
        return metrics

    def _record_trained(self, trajs, t_train: tuple[float, float]) -> None:
        """Audit trail and timeline: which rollouts (tasks, versions, sampling times, workers) each
        step trained on, and when it trained (wall-clock seconds since the epoch)."""
        md = [t.metadata for t in trajs]
        row = {"step": self.step, "rids": [int(m.get("rid", -1)) for m in md],
               "task_ids": [t.task_id for t in trajs],
               "versions": [sorted(set(t.action_versions)) for t in trajs],
               "action_tokens": [t.num_action_tokens for t in trajs],
               "workers": [m.get("worker") for m in md],
               "rollout_start": [m.get("t_start") for m in md], "rollout_end": [m.get("t_end") for m in md],
               "train_start": t_train[0], "train_end": t_train[1]}
        self._trained_log.write(json.dumps(row) + "\n")
        self._trained_log.flush()

    def _progress(self) -> Progress:
        return Progress(trainer_step=self.step, episode=self.feed.stats.finished)

    def _step_metrics(self, trajs, version, wait_s, train_s, window_s, elapsed_s) -> dict:
        stale = [t.staleness(version) for t in trajs]
        versions = {v for t in trajs for v in t.action_versions}
        tokens = sum(t.num_action_tokens for t in trajs)
        s = self.feed.stats
        m = {
            "step": self.step, "time/elapsed_s": elapsed_s, "time/wait_s": wait_s, "time/train_s": train_s,
            "time/trainer_idle_frac": wait_s / window_s if window_s > 0 else 0.0,
            "time/trainer_idle_frac_total": s.wait_s / elapsed_s if elapsed_s > 0 else 0.0,
            "reward/mean": statistics.fmean(t.total_reward for t in trajs),
            "reward/success_frac": statistics.fmean(float(bool(t.metadata.get("success"))) for t in trajs),
            "rollout/staleness_mean": statistics.fmean(stale), "rollout/staleness_max": max(stale),
            "rollout/versions_in_batch": len(versions),
            "rollout/action_tokens_mean": tokens / len(trajs),
            "rollout/truncated_frac": statistics.fmean(float(t.truncated) for t in trajs),
            "rollout/dropped_stale": s.dropped_stale, "rollout/requeued": s.requeued,
            "rollout/finished": s.finished, "rollout/trained": len(trajs),
            "throughput/trajectories_per_s": len(trajs) / window_s if window_s > 0 else 0.0,
            "throughput/action_tokens_per_s": tokens / window_s if window_s > 0 else 0.0,
        }
        m |= self._slot_utilisation()
        m["rollout/worker_restarts"] = getattr(self.parts.backend, "restarts", 0)
        return m

    def _slot_utilisation(self) -> dict:
        """Busy decode slots over all slots of the decode steps run so far (all workers)."""
        stats = self.parts.backend.engine_stats()
        busy = sum(s.get("busy_slot_steps", 0) for s in stats.values())
        total = sum(s.get("decode_steps", 0) for s in stats.values()) * self.cfg.rollout.engine_slots
        return {"rollout/slot_util": busy / total} if total else {}

    def _periodic(self, metrics: dict, trajs) -> None:
        cfg = self.cfg
        if cfg.run.eval_every and self.step % cfg.run.eval_every == 0:
            metrics |= self._evaluate()
        if cfg.run.samples_every and self.step % cfg.run.samples_every == 0:
            self.parts.write_samples(self.dir / "samples", self.step, trajs)
        if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0:
            self.checkpoint()

    def _evaluate(self) -> dict:
        t0 = time.monotonic()
        m = self.parts.evaluate(self.learner.policy, self._progress())
        m["time/eval_s"] = time.monotonic() - t0
        with open(self.dir / "eval.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": self.step, "policy/version": self.learner.version, **m}) + "\n")
        return m

    def checkpoint(self) -> Path:
        finished, pending, seg = self.feed.checkpoint_state()
        path = save_checkpoint(self.dir / "checkpoints", self.step, self.learner,
                               {"finished": finished, "journal_segment": seg},
                               pending, keep=self.cfg.run.keep_checkpoints)
        self.journal.prune_before(seg)
        return path

    def request_stop(self, *_args) -> None:
        if self._stop:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop = True
        self.logger.message("stopping: finishing the current step and writing a checkpoint "
                            "(Ctrl-C again to abort)")

    def _finish(self) -> None:
        self.feed.stop()  # nothing arrives after this: the final checkpoint is consistent
        try:
            if self.step > 0:
                self.checkpoint()
                self.parts.export_final(self.dir / "final", self.learner)
        finally:
            self.parts.backend.shutdown()
            self.journal.close()
            self.logger.close()
            self._trained_log.close()


def trainer_threads(cfg: SaorlConfig) -> int:
    """Torch threads for the trainer: what the rollout workers leave of the machine's cores."""
    return cfg.runtime.trainer_threads or max(
        1, (os.cpu_count() or 1) - cfg.rollout.num_workers * cfg.runtime.worker_threads)


def train(cfg: SaorlConfig, run_dir: Path | None = None, *, resume: bool = False) -> tuple[Path, dict]:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(trainer_threads(cfg))
    run_dir = run_dir if run_dir is not None else new_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = Run(cfg, run_dir, resume=resume)
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, run.request_stop)
    signal.signal(signal.SIGTERM, run.request_stop)
    try:
        final = run.loop()
    finally:
        signal.signal(signal.SIGINT, previous)
    return run_dir, final
