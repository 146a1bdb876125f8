"""The documented "bring your own dataset and reward function" path, end to end: the example's
parquet files and reward module, and a TRL user's conversational data with TRL-style reward
functions, ``saorl train`` in a subprocess with rollout workers."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
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
           "rollout.concurrent_episodes=4", "rollout.engine.slots=4", "--run-dir", str(run_dir)]
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
    end = read_jsonl(run_dir / "end.json")[0]  # how it ended: saorl plot tells it from a killed run
    assert (end["step"], end["steps"], end["why"]) == (2, 2, "done")
    phases = {r["phase"]: r for r in end["memory"]["phases"]}  # peak RSS per phase (runtime/memory.py)
    assert {"start-up checks", "run parts", "learner", "workers starting", "evaluation", "RL steps",
            "final checkpoint and shutdown"} <= set(phases)
    steps = phases["RL steps"]
    assert steps["trainer_mib"] > 100 and steps["helpers_mib"]["rollout worker 0"] > 100
    assert steps["total_mib"] >= steps["trainer_mib"] + steps["helpers_mib"]["rollout worker 0"] - 50
    assert "peak memory (RSS, MiB" in out.stdout + out.stderr and "| RL steps |" in out.stdout + out.stderr


TRL_REWARDS = '''
import re

def format_reward(completions, **kwargs):
    """TRL style: a list of conversational completions in, one float per completion out."""
    return [1.0 if re.fullmatch(r"\\s*-?\\d+\\s*", c[0]["content"]) else 0.0 for c in completions]

def correct(prompts, completions, answer, **kwargs):
    assert prompts[0][0]["role"] == "system"  # the conversation as the row holds it
    return [float(str(a) in c[0]["content"]) for c, a in zip(completions, answer)]
'''
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_train_on_conversations_with_weighted_trl_reward_functions(tmp_path):
    """Conversational rows (system + user messages) as parquet for training and as a Hub-style JSONL
    without ids for testing, a tokenizer with a chat template, two TRL-style functions weighted,
    ``run.report_to=none``: the run trains and logs each function's reward."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from saorl.models.tokenizer import load_tokenizer

    def rows(pairs):
        return [{"prompt": [{"role": "system", "content": "Answer with a number."},
                            {"role": "user", "content": f"{a}+{b}="}], "answer": a + b} for a, b in pairs]

    pq.write_table(pa.Table.from_pylist(rows([(a, b) for a in range(1, 9) for b in range(1, 5)])),
                   tmp_path / "train.parquet")
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows([(20, 1), (20, 2)])))
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    hf = load_tokenizer()  # the shipped one (the tiny policy's vocabulary), with a chat template
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(tmp_path / "tok"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "saorl.cli", "train", "env.type=prompt_reward",
           f"env.tasks_file={tmp_path / 'train.parquet'}", f"env.test_tasks_file={tmp_path / 'test.jsonl'}",
           "env.options.reward_fn=[trl_rewards:format_reward, trl_rewards:correct]",
           "env.options.reward_weights=[0.5, 1.0]", f"model.tokenizer={tmp_path / 'tok'}",
           "run.report_to=none", "sft.enabled=false", "value_pretrain.enabled=false",
           "trainer.steps=2", "trainer.batch_size=4", "run.eval_every=2", "run.eval_tasks=2",
           "run.progress=false", "rollout.max_new_tokens=6", "rollout.max_total_tokens=96",
           "rollout.concurrent_episodes=4", "rollout.engine.slots=4", "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows_ = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows_] == [0, 1, 2]
    for r in rows_[1:]:
        fmt, ok = r["env/reward/format_reward"], r["env/reward/correct"]
        assert 0.0 <= fmt <= 1.0 and 0.0 <= ok <= 1.0
        assert 0.0 <= r["reward/mean"] <= 1.5
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2] and "eval/env/reward/correct" in evals[-1]
    assert not (run_dir / "tb").exists()  # report_to=none: no tracker


ESCAPING_REWARD = '''
import os, time

def escape(prompt, completion, answer, pids, **row):
    """Forks, setsids and forks again: a process outside the child's group, re-parented to init."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            open(os.path.join(pids, str(os.getpid())), "w").close()
            time.sleep(10**6)
        os._exit(0)
    os.wait()
    return 0.0
'''


def test_nothing_a_reward_function_detaches_outlives_the_run(tmp_path):
    """The issue's reward (fork, setsid, fork) in rollout workers' children: after ``saorl train``
    exits 0, none of the detached processes is alive."""
    import json

    pids = tmp_path / "pids"
    pids.mkdir()
    (tmp_path / "escaping.py").write_text(ESCAPING_REWARD)
    rows = [{"prompt": f"{i}+1=", "answer": i + 1, "pids": str(pids)} for i in range(40)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "saorl.cli", "train", "env.type=prompt_reward",
           f"env.tasks_file={tmp_path / 't.jsonl'}", "env.num_test_tasks=4",
           "env.options.reward_fn=escaping:escape",
           "sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-dense", "trainer.steps=2",
           "trainer.batch_size=4",
           "run.eval_tasks=2", "run.progress=false", "run.report_to=none", "rollout.max_new_tokens=4",
           "rollout.max_total_tokens=32", "rollout.concurrent_episodes=4", "rollout.engine.slots=4",
           "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    detached = [int(p.name) for p in pids.iterdir()]
    assert len(detached) >= 8, detached  # every rewarded episode detached one
    time.sleep(0.5)
    alive = [p for p in detached if _alive(p)]
    assert not alive, f"{len(alive)} of {len(detached)} detached processes outlived the run"


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_reward_that_hangs_on_every_call_stops_the_run_saying_so(tmp_path):
    """Every call runs past env.call_timeout_s: the run stops after 8 deadlines in a row, naming the
    function and why, not after four tries of each rollout; the worker, whose env calls all hang,
    keeps its heartbeat (it is not taken for a stalled worker and restarted, though its env calls
    block longer than runtime.worker_stall_s and can fill the default thread pool)."""
    import json

    (tmp_path / "hanging.py").write_text("import time\n\ndef hang(prompt, completion, **row):\n"
                                         "    time.sleep(10**6)\n")
    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(40)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "saorl.cli", "train", "env.type=prompt_reward",
           f"env.tasks_file={tmp_path / 't.jsonl'}", "env.num_test_tasks=4",
           "env.options.reward_fn=hanging:hang", "env.call_timeout_s=6", "runtime.worker_stall_s=3",
           "sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-dense", "trainer.steps=2",
           "trainer.batch_size=4",
           # no step-0 evaluation: its 2 episodes only waited out a 6-s deadline of their own first
           "run.eval_tasks=2", "run.eval_at_start=false", "run.progress=false", "run.report_to=none",
           "rollout.max_new_tokens=4", "rollout.max_total_tokens=32", "--run-dir", str(tmp_path / "run")]
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 3, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    # one poll can bring several deadlines at once (4 rollouts in flight), so the count may pass 8
    n = re.search(r"the last (\d+) rollouts all ran past env.call_timeout_s", last)
    assert n and 8 <= int(n.group(1)) <= 8 + 4, last
    assert "seems to hang on every call" in last and "hanging:hang" in last, last
    assert "sent nothing for" not in out.stdout + out.stderr  # the worker's heartbeat went on
    assert time.monotonic() - t0 < 120
