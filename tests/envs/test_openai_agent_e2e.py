"""The documented OpenAI-API agent path end to end: the example calculator agent (a plain ``openai``
loop with one tool) and its tasks, ``saorl train`` with the example's few-line config in a
subprocess with rollout workers, on the tiny model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from saorl.data.jsonl import read_jsonl
from saorl.models.tiny import build_tiny

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_train_the_example_openai_agent_as_it_is(tmp_path):
    from saorl.models.tokenizer import load_tokenizer

    data = tmp_path / "data"
    make = [sys.executable, str(EXAMPLE / "make_tasks.py"), str(data), "--train", "32", "--test", "2"]
    subprocess.run(make, check=True, capture_output=True)
    hf = load_tokenizer()  # the tiny policy's vocabulary, with a chat template (it ships none)
    hf.chat_template = CHATML
    hf.save_pretrained(str(tmp_path / "tok"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "saorl.cli", "train", str(EXAMPLE / "train.yaml"),
           f"env.tasks_file={data / 'train.jsonl'}", f"env.test_tasks_file={data / 'test.jsonl'}",
           f"model.tokenizer={tmp_path / 'tok'}", "model.policy=tiny-moe", "trainer.steps=2",
           "trainer.batch_size=4", "run.eval_every=2", "run.eval_tasks=2", "run.progress=false",
           "run.report_to=none", "rollout.max_new_tokens=24", "rollout.max_total_tokens=512",
           "rollout.concurrent_episodes=4", "rollout.engine.slots=4", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert all(v is None or math.isfinite(v) for v in r.values() if isinstance(v, (int, float))), r
        assert r["env/segments_per_episode"] >= 1.0 and r["env/calls_per_episode"] >= 1.0
        assert 0.0 <= r["reward/mean"] <= 1.0 and "env/tool_calls" in r  # the agent's own metric
    assert [e["eval/episodes"] for e in read_jsonl(run_dir / "eval.jsonl")] == [2, 2]
    trained = [tid for row in read_jsonl(run_dir / "trained.jsonl") for tid in row["task_ids"]]
    assert len(trained) == 8
    init = build_tiny("tiny-moe", seed=0).state_dict()
    ckpt = load_file(str(run_dir / "checkpoints" / "step-00000002" / "policy.safetensors"))
    assert sum(not torch.equal(init[k], ckpt[k]) for k in init) > len(init) // 2
