"""Values derived from a run's config, each with one home: the worker processes, the trainer's threads,
the sampling settings."""

from saorl.config import load_config
from saorl.engines.base import SamplingParams


def test_trainer_threads_are_what_the_workers_leave_of_the_cores(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config(None, ["runtime.backend=local", "rollout.num_workers=2", "runtime.worker_threads=3"])
    assert cfg.worker_processes == 2
    assert cfg.trainer_threads(cores=16) == 10 and cfg.trainer_threads(cores=4) == 1
    inproc = load_config(None, ["runtime.backend=inprocess", "rollout.num_workers=2"])
    assert inproc.worker_processes == 0 and inproc.trainer_threads(cores=6) == 6
    pinned = load_config(None, ["runtime.trainer_threads=5"])
    assert pinned.trainer_threads(cores=2) == 5


def test_sampling_settings_of_a_runs_rollout_section():
    cfg = load_config(None, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5",
                             "rollout.max_new_tokens=33"])
    assert SamplingParams.of_rollout(cfg.rollout) == SamplingParams(temperature=0.7, top_p=0.9, top_k=5,
                                                                     max_new_tokens=33)
    assert SamplingParams.of_rollout(cfg.rollout, temperature=0.0).temperature == 0.0
