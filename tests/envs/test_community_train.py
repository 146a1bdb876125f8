"""``saorl train`` on the community envs, end to end with the tiny model: a mix of a reasoning-gym
generator and a multi-turn TextArena game (two steps), which trains each and evaluates each."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from saorl.data.jsonl import read_jsonl

from .community import need

need("reasoning_gym")
need("textarena")
pytestmark = pytest.mark.slow

MIX = ("env.mix=[{type: reasoning_gym, name: arith, options: {dataset: basic_arithmetic, prompt: text, "
       "system_prompt: direct, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}}, "
       "{type: textarena, name: guess, options: {game: GuessTheNumber-v0, max_turns: 3}}]")


def test_train_a_mix_of_reasoning_gym_and_textarena(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "saorl.cli", "train", MIX, "env.num_train_tasks=32", "env.num_test_tasks=4",
           "sft.enabled=false", "value_pretrain.enabled=false", "trainer.steps=2", "trainer.batch_size=4",
           "run.eval_every=2", "run.eval_tasks=4", "run.progress=false", "rollout.max_new_tokens=6",
           "rollout.max_total_tokens=400", "rollout.concurrent_episodes=4", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for step in (0, 2):
        for part in ("arith", "guess"):
            assert f"step {step} eval {part}: accuracy " in out.stderr and "(2 episodes)" in out.stderr
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(e[f"eval/{p}/episodes"] == 2 and 0 <= e[f"eval/{p}/accuracy"] <= 1 for e in evals
               for p in ("arith", "guess"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    trained_keys = {k for r in rows[1:] for k in r if k.startswith("env/")}
    assert trained_keys & {"env/arith/reward", "env/guess/reward"}
    assert all(math.isfinite(r[k]) for r in rows[1:] for k in r if k.startswith("env/"))
    trained = [tid for row in read_jsonl(run_dir / "trained.jsonl") for tid in row["task_ids"]]
    assert len(trained) == 8 and all(t.split("/")[0] in ("arith", "guess") for t in trained)
    # a game is several turns (an invalid move gets a second try), a reasoning-gym problem one
    assert all(e["eval/turns_mean"] > 1.0 for e in evals)
