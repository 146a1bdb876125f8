"""The documented "bring your own dataset and reward function" path, end to end: the example's
parquet files and reward module, ``saorl train`` in a subprocess with rollout workers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from saorl.data.jsonl import read_jsonl
from saorl.data.tasks import read_tasks

pytest.importorskip("pyarrow")
pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prompt_reward"


def test_train_on_a_parquet_dataset_with_a_reward_function_module(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(data), "--train", "64", "--test", "8"],
                   check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "saorl.cli", "train", "env.type=prompt_reward",
           f"env.tasks_file={data / 'train.parquet'}", f"env.test_tasks_file={data / 'test.parquet'}",
           "env.options.reward_fn=my_rewards:correct", "sft.enabled=false", "value_pretrain.enabled=false",
           "trainer.steps=2", "trainer.batch_size=4", "run.eval_every=2", "run.eval_tasks=4",
           "run.progress=false", "rollout.max_new_tokens=6", "rollout.max_total_tokens=32",
           "rollout.concurrent_episodes=4", "rollout.engine_slots=4", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the evaluation before any training
    assert all(math.isfinite(r["reward/mean"]) and 0.0 <= r["reward/mean"] <= 1.0 for r in rows[1:])
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval/episodes"] == 4 for e in evals)
    train_ids = {t.id for t in read_tasks(data / "train.parquet")}
    trained = [tid for row in read_jsonl(run_dir / "trained.jsonl") for tid in row["task_ids"]]
    assert len(trained) == 8 and set(trained) <= train_ids
