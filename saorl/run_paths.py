"""The names inside a run directory, in one place.

A run directory (``saorl train`` writes it; ``eval``, ``serve``, ``replay``, ``report`` and
``--resume`` read it) holds::

    config.yaml            the resolved config (what a resume or an eval loads)
    algo_resolved.yaml     the algorithm preset after overrides (informational)
    metrics.jsonl          one row per logged step (and resume markers)
    trained.jsonl          which rollouts each step trained on (and resume markers)
    eval.jsonl             one row per evaluation
    errors.log             the full text of the failures the run survived
    alarms.jsonl           the alarms raised while it ran (saorl.runtime.alarms), one a line
    stability.json         the run's stability signals, written when it ends
    end.json               how its last start ended (done, budget, stopped, failed); absent: killed
    samples/               a few decoded trajectories per step
    checkpoints/           step-NNNNNNNN/ directories and the ``latest`` pointer
    journal/               the fsynced segments of finished trajectories
    weights/               the published policy versions the workers load
    final/                 policy/ (and critic/, adapter/): the exported models
    replays/               what ``saorl replay`` wrote (by default)
    .lock                  held by the trainer that owns the directory

:class:`RunPaths` names each of these once; every module that reads or writes a run directory
takes its paths from it rather than spelling a name again. It imports nothing but the standard
library, so the config layer and the commands use it without loading the trainer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """The paths of the run directory ``root`` (nothing is created or checked here)."""

    root: Path

    def __init__(self, root: str | os.PathLike) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def algo_resolved(self) -> Path:
        return self.root / "algo_resolved.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def trained(self) -> Path:
        return self.root / "trained.jsonl"

    @property
    def eval(self) -> Path:
        return self.root / "eval.jsonl"

    @property
    def errors(self) -> Path:
        return self.root / "errors.log"

    @property
    def alarms(self) -> Path:
        return self.root / "alarms.jsonl"

    @property
    def stability(self) -> Path:
        return self.root / "stability.json"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def final_policy(self) -> Path:
        return self.final / "policy"

    @property
    def final_critic(self) -> Path:
        return self.final / "critic"

    @property
    def final_adapter(self) -> Path:
        return self.final / "adapter"

    @property
    def end(self) -> Path:
        """How the run's last start ended, written when it ends in order (``saorl plot`` reads it)."""
        return self.root / "end.json"

    @property
    def plot(self) -> Path:
        """The run's picture (``saorl plot``; ``saorl train`` draws it at the end)."""
        return self.root / "run.png"

    @property
    def replays(self) -> Path:
        """Where ``saorl replay`` writes its replays by default, one timestamped directory each."""
        return self.root / "replays"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def write_dirs(self) -> tuple[Path, ...]:
        """Where atomic writes put their temporaries: the directory itself, ``checkpoints/``,
        ``weights/``, ``final/`` and ``journal/``."""
        return (self.root, self.checkpoints, self.weights, self.final, self.journal)
