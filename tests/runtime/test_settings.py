"""RunSettings: what the run loop reads of the config, unpacked once; the loop never sees the config."""

import ast
import dataclasses
from pathlib import Path

import pytest

from saorl.config import load_config
from saorl.runtime.settings import RunSettings

RUNTIME = Path(__file__).resolve().parents[2] / "saorl" / "runtime"


def test_from_config_reads_each_setting_from_its_field():
    cfg = load_config(None, ["trainer.steps=7", "trainer.batch_size=6", "trainer.max_staleness=2",
                             "trainer.max_wall_s=30", "trainer.stop_timeout_s=12",
                             "trainer.max_nonfinite_skips=9",
                             "trainer.policy_lr=2e-5", "trainer.critic_lr=3e-4", "run.eval_every=3",
                             "run.eval_tasks=5", "run.eval_at_start=false", "run.samples_every=4",
                             "run.checkpoint_every=11", "run.checkpoint_every_s=90", "run.keep_checkpoints=3",
                             "run.resume_fallback=false",
                             "run.progress=false", "rollout.engine.slots=3"])
    assert RunSettings.from_config(cfg) == RunSettings(
        steps=7, batch_size=6, max_staleness=2, max_wall_s=30.0, stop_timeout_s=12.0, max_nonfinite_skips=9,
        policy_lr=2e-5, critic_lr=3e-4, eval_every=3, eval_tasks=5, eval_at_start=False, samples_every=4,
        checkpoint_every=11, checkpoint_every_s=90.0, keep_checkpoints=3, resume_fallback=False,
        progress=False, engine_slots=3)


def test_frozen():
    s = RunSettings.from_config(load_config(None, []))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 1


@pytest.mark.parametrize("module", ["run.py", "resume.py", "settings.py"])
def test_the_loop_imports_no_config(module):
    """run.py reads its settings record, never the config tree (settings.py names the type only
    for its checker)."""
    tree = ast.parse((RUNTIME / module).read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    bad = [n.module for n in top
           if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("saorl.config")]
    assert not bad, f"saorl/runtime/{module} imports {bad}"
