"""``saorl train`` on ``env.type=bfcl`` with the tiny model: two steps and two evaluations on the real
bfcl-eval (its tasks' prompts, in the tiny tokenizer, are 2,000-4,700 tokens: the overlong ones are
left out, as env.overlong_prompts=filter says)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from saorl.data.jsonl import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bfcl")]


def test_train_two_steps_on_bfcl(tmp_path):
    from saorl.envs import bfcl_data

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "saorl.cli", "train", "env.type=bfcl",
           "env.options={prompt: text, tool_prompt: list}", "env.num_train_tasks=8", "env.num_test_tasks=2",
           "sft.enabled=false", "value_pretrain.enabled=false", "trainer.steps=2", "trainer.batch_size=2",
           "run.eval_every=2", "run.eval_tasks=2", "run.progress=false", "rollout.max_new_tokens=8",
           "rollout.max_total_tokens=3000", "rollout.concurrent_episodes=2", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "left out (env.overlong_prompts=filter)" in out.stdout + out.stderr
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(0 <= e["eval/accuracy"] <= 1 and e["eval/env/requests"] >= 1 for e in evals)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all({"env/tool_calls", "env/tool_errors", "env/requests"} <= set(r) for r in rows[1:])
    trained = [tid for row in read_jsonl(run_dir / "trained.jsonl") for tid in row["task_ids"]]
    train_ids = set(bfcl_data.split_ids("multi_turn_base")["train"])
    assert len(trained) == 4 and set(trained) <= train_ids
