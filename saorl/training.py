"""``train``: the stages before RL, in order, then the run.

1. warm start: the policy RL starts from (``model.policy``, or its cached SFT fine-tune);
2. value pretraining: the critic RL starts from (cached), when the algorithm asks for one;
3. the run's parts (models, env, task splits, backend, weights), then :class:`~saorl.runtime.run.Run`
   until ``trainer.steps``, ``trainer.max_wall_s`` or Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import os
import signal
from datetime import datetime
from pathlib import Path

import torch

from saorl.config import SaorlConfig
from saorl.runtime.observe import Observer
from saorl.runtime.parts import build_parts
from saorl.runtime.run import Run
from saorl.runtime.trackers import check_trackers
from saorl.stages.evaluate import TestEvaluator
from saorl.stages.sft import warm_start
from saorl.stages.value_pretrain import initial_critic


def new_run_dir(cfg: SaorlConfig) -> Path:
    """A fresh ``run.out_dir/<run.name>-<timestamp>`` (a suffix when that exists already)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    d = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    n = 1
    while d.exists():
        d = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}-{n}"
        n += 1
    d.mkdir(parents=True)
    return d


def trainer_threads(cfg: SaorlConfig) -> int:
    """Torch threads for the trainer: what the rollout workers leave of the machine's cores."""
    workers = 0 if cfg.runtime.backend == "inprocess" else cfg.rollout.num_workers
    return cfg.runtime.trainer_threads or max(1, (os.cpu_count() or 1) - workers * cfg.runtime.worker_threads)


def train(cfg: SaorlConfig, run_dir: Path | None = None, *, resume: bool = False,
          observer: Observer | None = None) -> tuple[Path, dict]:
    """Run the stages and the RL run of ``cfg`` in ``run_dir`` (a new one when None).

    Returns the run directory and the last step's metrics. ``resume`` continues the run in
    ``run_dir`` from its last checkpoint and journal. ``observer`` watches the run.
    """
    check_trackers(cfg.run.report_to)  # a missing tracker package fails now, not after the stages
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(trainer_threads(cfg))
    policy_spec = warm_start(cfg)
    critic_spec = initial_critic(cfg, policy_spec)
    run_dir = run_dir if run_dir is not None else new_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    parts = build_parts(cfg, run_dir, policy_spec, critic_spec)
    run = Run(cfg, run_dir, parts, TestEvaluator(cfg, parts.tokenizer, parts.env_factory, parts.test_tasks),
              resume=resume, observer=observer)
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, run.request_stop)
    signal.signal(signal.SIGTERM, run.request_stop)
    try:
        final = run.loop()
    finally:
        signal.signal(signal.SIGINT, previous)
    return run_dir, final
