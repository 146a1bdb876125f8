"""A run assembled from its built parts: the one place the run's config is unpacked.

:func:`build_run` takes the parts (:func:`~saorl.runtime.parts.build_parts`: models, env, tasks,
backend, weights, the algorithm's preset resolved once) and builds what the loop drives besides
them — the learner, the run directory's journal and recorder — then readies the directory:
temporaries a crash left are removed, a resume restores its checkpoint and journal
(:func:`~saorl.runtime.resume.restore`), the config now in force is saved, the learner's first
version is published, and the trackers start, last (a start that fails before them leaves no
tracker files for its clean-up to remove). The :class:`~saorl.runtime.run.Run` it returns
reads only its :class:`~saorl.runtime.settings.RunSettings`.
"""

from __future__ import annotations

from pathlib import Path

from saorl.config import SaorlConfig, config_to_dict, save_resolved
from saorl.run_paths import RunPaths
from saorl.runtime.disk import check_room, checkpoint_bytes
from saorl.runtime.journal import Journal
from saorl.runtime.memory import MemoryWatch
from saorl.runtime.observe import Observer
from saorl.runtime.parts import RunParts, build_learner
from saorl.runtime.recorder import RunRecorder
from saorl.runtime.resume import Start, restore
from saorl.runtime.run import Evaluator, Run
from saorl.runtime.rundir import remove_temporaries
from saorl.runtime.settings import RunSettings
from saorl.runtime.trackers import Trackers


def build_run(cfg: SaorlConfig, run_dir: Path, parts: RunParts, evaluate: Evaluator, *, resume: bool = False,
              restart: bool = False, observer: Observer | None = None,
              memory: MemoryWatch | None = None) -> Run:
    """The run of ``cfg`` in ``run_dir`` (created and locked by the caller) over ``parts``;
    ``resume`` continues from the directory's checkpoint and journal, ``restart`` (with it) from
    step 0 even if training on record is lost; ``memory`` is the watch of the stages before (the
    run starts its own when None). On failure the weights, journal and recorder are closed; the
    backend and env are the caller's."""
    settings, paths = RunSettings.from_config(cfg), RunPaths(run_dir)
    if memory is not None:
        memory.enter("learner")
    learner = build_learner(cfg, parts.preset, parts.policy, parts.critic, parts.tokenizer.pad_token_id)
    journal = Journal(paths.journal)
    recorder = RunRecorder(paths.root, parts.tokenizer, progress=settings.progress,
                           total_steps=settings.steps)
    try:
        removed = remove_temporaries(paths.root)  # the caller holds the run directory's lock
        check_room(paths.root, checkpoint_bytes(learner))  # a disk too small for one checkpoint: now
        if removed:
            recorder.message(f"removed what a crash left half-written: {', '.join(removed)}")
        start = Start()
        if resume:
            start = restore(paths, learner, journal, recorder, parts.weights,
                            fallback=settings.resume_fallback, restart=restart)
        save_resolved(cfg, paths.root)  # on resume: the config now in force, overrides included
        learner.publish(parts.weights)
        run = Run(settings, paths, parts, learner, journal, recorder, evaluate, start, observer=observer,
                  memory=memory)
        recorder.trackers = Trackers(cfg.run.report_to, paths.root, project=cfg.run.tracker_project,
                                     options=cfg.run.tracker_options, config=config_to_dict(cfg))
    except BaseException:
        parts.weights.close()
        journal.close()
        recorder.close()
        raise
    return run
