"""``train``: the stages before RL, in order, then the run.

0. start-up checks (:mod:`saorl.stages.preflight`): env, models, device, task files, demonstrations;
   the run's estimated peak memory against the machine's free memory (:mod:`saorl.stages.memory_check`);
1. warm start: the policy RL starts from (``model.policy``, or its cached SFT fine-tune);
2. value pretraining: the critic RL starts from (cached), when the algorithm asks for one;
3. the run's parts (models, env, task splits, backend, weights), then :class:`~saorl.runtime.run.Run`
   until ``trainer.steps``, ``trainer.max_wall_s`` or Ctrl-C / SIGTERM (which stop it in bounded
   time: :mod:`saorl.runtime.stopping`).

The run directory is checked first (:func:`~saorl.runtime.rundir.check_run_dir`: a fresh run
needs a new or empty one, a resume an existing run), then created and locked at once, before the
start-up checks, so the path ``saorl train`` prints first exists while the warm start and value
pretraining run (their caches are under ``run.out_dir/.cache``)
(:func:`~saorl.runtime.rundir.claim_run_dir`: one trainer per directory, for
the run's lifetime); a resumed run's directory exists, so it is locked at once too (a second trainer
is refused before any slow check), and a resume that would restart from step 0 and lose the
training on record is refused then too (:func:`~saorl.runtime.checkpoint.check_restart`,
unless ``restart``). If anything before the loop fails (or is interrupted), a run directory that
this call created is removed again (with the parents it created, such as ``runs/``), so a failed
start leaves nothing behind — unless a tracker
wrote into it: the trackers start last (:mod:`saorl.runtime.trackers`), and when one of them fails
after another started, the directory is kept with what that one wrote (W&B's offline run, say),
and the error says so. The config's paths
are made absolute first (:func:`~saorl.config.absolute_paths`): the saved ``config.yaml`` means
the same from any directory.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import torch

from saorl.config import SaorlConfig, absolute_paths
from saorl.envs.escapees import kill_run_escapees, new_run_mark
from saorl.errors import RunFailure, StartupError
from saorl.models.shelf import PolicyShelf
from saorl.proctitle import name_run
from saorl.run_paths import RunPaths
from saorl.runtime.assemble import build_run
from saorl.runtime.checkpoint import check_restart
from saorl.runtime.disk import checkpoint_bytes, disk_errno, disk_failure, probe_run_dir
from saorl.runtime.learner import shard_group
from saorl.runtime.memory import MemoryWatch
from saorl.runtime.observe import Observer
from saorl.runtime.parts import build_learner, build_parts
from saorl.runtime.run import Run
from saorl.runtime.rundir import RunDirLock, check_run_dir, claim_run_dir, new_run_dir, remove_temporaries
from saorl.runtime.trackers import TrackerFailed
from saorl.stages.estimate import start_up_estimate
from saorl.stages.evaluate import TestEvaluator
from saorl.stages.memory_check import check_memory
from saorl.stages.preflight import check_ray, check_run, check_servers
from saorl.stages.sft import warm_start
from saorl.stages.value_pretrain import initial_critic


def train(cfg: SaorlConfig, run_dir: Path | None = None, *, resume: bool = False, restart: bool = False,
          observer: Observer | None = None) -> tuple[Path | None, dict]:
    """Run the stages and the RL run of ``cfg`` in ``run_dir`` (a new one when None).

    Returns the run directory and the last step's metrics (``(None, {})`` on a sharded trainer's
    ranks other than 0, which only serve rank 0's learner). ``resume`` continues the run in
    ``run_dir`` from its last checkpoint and journal; ``restart`` (with ``resume``) lets it start
    from step 0 when no checkpoint is left even though training is on record (it is discarded).
    ``observer`` watches the run. Raises
    :class:`~saorl.runtime.rundir.RunDirError` when ``run_dir`` does not suit (a fresh run into a
    non-empty directory, a resume of a directory that holds no run, a directory in use),
    :class:`~saorl.runtime.rundir.CorruptionError` when a resume finds damage it cannot go around
    (or would silently restart from step 0),
    and :class:`~saorl.runtime.run.NonFiniteError` when updates keep being non-finite.
    """
    cfg = absolute_paths(cfg)
    group = shard_group.join(cfg.model.device) if cfg.trainer.shard == "fsdp2" else None
    if group is not None and group.rank > 0:
        torch.set_num_threads(cfg.trainer_threads())
        serve_rank(cfg)
        return None, {}
    new_run_mark()  # before any worker starts: their user code's processes carry it (saorl.envs.escapees)
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
    name_run(run_dir.name)  # its helper processes say so in ps (saorl.proctitle)
    check_run_dir(run_dir, resume=resume)  # before minutes of checks, warm start and pretraining
    probe_run_dir(run_dir)  # and a read-only or full disk too
    created = _first_missing(run_dir)  # what to remove again if the start fails (None: it existed)
    locks: list[RunDirLock] = []
    memory = MemoryWatch().start("start-up checks")  # peak RSS per phase, into end.json (runtime/memory.py)
    try:
        # created (a fresh run) and locked now, before minutes of checks, warm start and pretraining:
        # the path printed first exists while they run, and a second trainer is refused at once
        locks.append(claim_run_dir(run_dir, resume=resume))
        if resume:  # a lost history is refused now
            check_restart(run_dir, restart=restart)
            done = finished_at(run_dir, cfg.trainer.steps)
            if done is not None:  # a finished run: nothing to redo, nothing rewritten
                print(f"{run_dir}: already trained to step {done} (trainer.steps={cfg.trainer.steps}) and "
                      f"exported to final/; nothing to do. To train on: saorl train --resume {run_dir} "
                      f"trainer.steps={max(2 * done, done + 1)}")
                locks.pop().release()
                memory.stop()
                if group is not None:
                    group.command("close")  # the other ranks wait for the stages or the learner
                    shard_group.leave()
                return run_dir, {}
        run = _start(cfg, run_dir, resume, restart, observer, memory)
    except BaseException as e:
        memory.stop()
        for lock in locks:
            lock.release()
        # a failed start leaves no (empty or half-written) run directory behind, nor removes a tracker's files
        if created is not None and not (isinstance(e, TrackerFailed) and e.started):
            _remove_created(run_dir, created)
        if disk_errno(e) is not None and not isinstance(e, (StartupError, RunFailure)):
            raise disk_failure(e, run_dir, None, []) from e
        raise
    previous = {sig: signal.signal(sig, run.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        final = run.loop()
    except Exception as e:
        if disk_errno(e) is None or isinstance(e, RunFailure):
            raise
        # the run holds the lock: what the failed write left half-written goes now, not at the resume
        raise disk_failure(e, run_dir, checkpoint_bytes(run.learner), remove_temporaries(run_dir)) from e
    finally:
        run.stop.done()  # the stop, if one was asked for, is done: no forced one now
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        run.parts.env_factory.close()  # the processes of user code: idle ones, and any still stuck
        kill_run_escapees()  # and what it detached, in the workers' pools too (saorl.envs.escapees)
        if group is not None:
            run.learner.close()
            shard_group.leave()
        locks[0].release()
        memory.stop()
    return run_dir, final


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (``runs/`` on a first run), or None."""
    if path.exists():
        return None
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top


def _remove_created(run_dir: Path, top: Path) -> None:
    """Remove ``run_dir``, then the parents this start created up to ``top`` while they are empty
    (``runs/`` stays when the warm start cached into ``runs/.cache``)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    d = run_dir.parent
    while d != top.parent and d != d.parent:
        try:
            d.rmdir()
        except OSError:
            return  # not empty (a stage's cache), or gone
        d = d.parent


def finished_at(run_dir: Path, steps: int) -> int | None:
    """The step a finished run reached — its newest checkpoint is at ``steps`` or past it and
    ``final/`` holds the exported policy — or None (a run to continue)."""
    from saorl.runtime.checkpoint import MANIFEST, latest_checkpoint

    paths = RunPaths(run_dir)
    ckpt = latest_checkpoint(paths.checkpoints)
    if ckpt is None or not (paths.final_policy / "config.json").is_file():
        return None
    try:
        step = int(json.loads((ckpt / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged manifest: the resume's own checks say what is wrong
    return step if step >= steps else None


def _start(cfg: SaorlConfig, run_dir: Path, resume: bool, restart: bool, observer: Observer | None,
           memory: MemoryWatch) -> Run:
    """Checks, warm start, value pretraining, parts: a :class:`Run` ready to loop in ``run_dir``
    (created and locked by the caller); ``memory`` is told each phase as it begins."""
    check_run(cfg)
    check_servers(cfg)  # before minutes of warm start: a server the run cannot use is refused now
    check_ray(cfg)  # and a Ray cluster that does not answer, or lacks the workers' resources
    check_memory(cfg)  # a machine with less memory free than the run's estimate: said now
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer_threads())
    shelf = PolicyShelf()  # the policy in memory, handed from phase to phase (saorl.models.shelf)
    memory.enter("start-up estimate")
    start_up_estimate(cfg, run_dir, resume=resume, shelf=shelf)  # each phase's time, timed here
    memory.enter("warm start")
    policy_spec = warm_start(cfg, shelf=shelf)
    memory.enter("value pretraining")
    critic_spec = initial_critic(cfg, policy_spec, shelf=shelf)
    memory.enter("run parts")
    parts = build_parts(cfg, cfg.algo.preset, run_dir, policy_spec, critic_spec, shelf)  # resolved at load
    shelf.clear()  # what no phase took is freed before the run
    try:
        evaluator = TestEvaluator(cfg, parts.tokenizer, parts.env_factory, parts.test_tasks)
        return build_run(cfg, run_dir, parts, evaluator, resume=resume, restart=restart, observer=observer,
                         memory=memory)
    except BaseException:
        try:
            parts.backend.shutdown()  # a Ray cluster is up from build_parts on: never leave it behind
        finally:
            parts.weights.close()  # a server client's connections and thread (close is idempotent)
            parts.env_factory.close()
        raise


def serve_rank(cfg: SaorlConfig) -> None:
    """A sharded trainer's rank other than 0: the same learner, on rank 0's models, serving rank
    0's commands until it closes (docs/scaling.md). Rank 0 owns Ctrl-C and SIGTERM: it finishes
    its step and checkpoint, which need this rank, then releases it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from saorl.runtime.learner.shard_stages import serve_stages

    try:  # SFT and value pretraining's fits, if rank 0 runs them, then the learner
        serve_stages(shard_group.current(), lambda: build_learner(cfg, cfg.algo.preset, None, None, None))
    finally:
        shard_group.leave()
