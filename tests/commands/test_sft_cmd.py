"""``saorl sft``: fine-tunes into an HF directory, writes the loss metrics, prints before/after."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from saorl.cli import main
from saorl.models.tiny import build_tiny

TINY = ["sft.steps=5", "sft.num_demos=8", "sft.batch_size=4", "env.num_test_tasks=4",
        "model.policy=tiny-dense", "env.options.max_turns=2", "rollout.max_new_tokens=6",
        "rollout.max_total_tokens=96"]


@pytest.mark.slow
def test_sft_writes_a_loadable_fine_tuned_policy_and_prints_before_after(tmp_path, capsys):
    out = tmp_path / "sft"
    assert main(["sft", *TINY, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("metric"))
    assert header.split() == ["metric", "before", "after"]
    assert "accuracy" in printed and "test split, 4 episodes, temperature 1" in printed

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    init = dict(build_tiny("tiny-dense", seed=0).named_parameters())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, init[n])]
    assert changed and len(changed) == len(init)  # every parameter took a gradient step

    metrics = json.loads((out / "sft_metrics.json").read_text())
    assert metrics["sft/demos"] == 8 and math.isfinite(metrics["sft/loss"]) and metrics["sft/loss"] > 0
    for side in ("before", "after"):
        assert metrics[f"{side}/eval/episodes"] == 4.0
        assert 0.0 <= metrics[f"{side}/eval/accuracy"] <= 1.0


def test_sft_bad_inputs_exit_2(tmp_path, capsys):
    assert main(["sft", "sft.stepz=5", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean steps" in capsys.readouterr().err
    assert main(["sft", "model.policy=/no/such/policy", "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sft", *TINY, "--tasks", "0", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
