"""How many times ``saorl train`` loads the policy before RL step 1 (saorl.models.shelf).

Counted where a model is made (a tiny kind built, an HF directory read by ``from_pretrained``),
whatever called it, up to the first call of the run's loop."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

import saorl.models.loading as loading
from saorl.config import load_config
from saorl.runtime.run import Run
from saorl.training import train

SMALL = ["trainer.steps=1", "sft.steps=4", "sft.num_demos=16", "sft.batch_size=8",
         "value_pretrain.rollouts=4", "value_pretrain.steps=1", "value_pretrain.batch_size=2",
         "value_pretrain.curve=false", "run.eval_tasks=0", "env.num_test_tasks=2", "run.progress=false",
         "rollout.num_workers=1", "rollout.max_new_tokens=8", "rollout.max_total_tokens=96"]


def _loads_before_step_1(monkeypatch, tmp_path, overrides: list[str]) -> list[str]:
    made: list[str] = []
    looping = []
    build_tiny, from_pretrained = loading.build_tiny, AutoModelForCausalLM.from_pretrained.__func__

    def counted_tiny(*a, **k):
        if not looping:
            made.append(f"tiny {a[0]}")
        return build_tiny(*a, **k)

    def counted_dir(cls, path, *a, **k):
        if not looping:
            made.append(f"dir {path}")
        return from_pretrained(cls, path, *a, **k)

    loop = Run.loop

    def first_loop(self, *a, **k):
        looping.append(True)
        return loop(self, *a, **k)

    monkeypatch.setattr(loading, "build_tiny", counted_tiny)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counted_dir))
    monkeypatch.setattr(Run, "loop", first_loop)
    cfg = load_config(None, [*overrides, f"run.out_dir={tmp_path}/out"])
    train(cfg, tmp_path / "run")
    assert looping, "the run never reached its loop"
    return made


@pytest.mark.slow
def test_the_trainer_loads_the_policy_once_before_step_1_with_worker_processes(monkeypatch, tmp_path):
    """SFT builds ``model.policy`` and trains it; value pretraining samples with the trained model
    and the trainer trains it on: no phase reads the exported warm start back (it loaded 3 times)."""
    made = _loads_before_step_1(monkeypatch, tmp_path, SMALL)
    assert made == ["tiny tiny-moe"], made


@pytest.mark.slow
def test_the_start_up_estimate_s_calibration_borrows_the_policy_the_phases_then_take(monkeypatch, tmp_path):
    """``run.estimate``: its calibration (a pass, an AdamW step of zero rate, decode steps) times
    the model the phases after it train, not a load of its own (SmolLM2: one load in all, not two)."""
    made = _loads_before_step_1(monkeypatch, tmp_path, [*SMALL, "run.estimate=true"])
    assert made == ["tiny tiny-moe"], made
    assert (tmp_path / "run" / "estimate.json").is_file()


@pytest.mark.slow
def test_the_in_process_engine_loads_its_own_copy(monkeypatch, tmp_path):
    """``runtime.backend: inprocess``: the engine's model is a load of its own (a copy's log-probs
    differ from a load's by ~1e-7), the trainer's is SFT's (4 loads before)."""
    made = _loads_before_step_1(monkeypatch, tmp_path, [*SMALL, "runtime.backend=inprocess"])
    assert len(made) == 2, made
    assert made[0] == "tiny tiny-moe" and made[1].startswith("dir ") and "sft-" in made[1], made
