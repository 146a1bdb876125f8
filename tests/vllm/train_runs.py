"""What the real-vLLM training tests share (``test_vllm_train.py``, ``test_vllm_lora.py``): the
run's overrides, its step rows, the exactness bounds, and a trainer killed with SIGKILL and
resumed while the server stays up."""

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from runtime_helpers import read_jsonl, resume_train, session_pids, wait_for_steps, wait_until_gone

KL_S0_MAX = 1e-6
GAP_MAX = 1e-5


def overrides(url: str) -> list[str]:
    """The tiny dense policy (tied head, head_dim 32) on math_tool, rollout workers in their own
    processes talking to the server, every version verified on it."""
    return ["sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-dense",
            "env.num_train_tasks=400", "env.num_test_tasks=4", "run.eval_every=1000", "run.eval_tasks=2",
            "run.samples_every=1000", "run.progress=false", "rollout.concurrent_episodes=8",
            "rollout.max_new_tokens=12", "rollout.max_total_tokens=80", "trainer.batch_size=4",
            "rollout.engine=vllm", f"rollout.engine.urls=[{url}]", "rollout.engine.model=policy",
            "rollout.engine.verify_every=1", "rollout.temperature=0.9", "rollout.top_p=0.95"]


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) > 0 and "resume" not in r]


def assert_exact(rows: list[dict]) -> None:
    for r in rows:
        if r.get("mismatch/tokens_s0"):
            assert r["mismatch/kl_s0"] <= KL_S0_MAX, r
        assert r["weights/verify_max_gap"] < GAP_MAX, r  # verify_every=1: every version checked


def killed_and_resumed(args: list[str], run_dir: Path, tmp_path: Path, total: int,
                       published: Callable[[Path], int]) -> tuple[int, dict, list[dict]]:
    """``saorl train ARGS --run-dir RUN_DIR`` killed with SIGKILL (its whole session) after step 3,
    then resumed to step ``total`` with the server up; ``(the newest version published before the
    kill — published(run_dir) —, the resume marker, the step rows from the marker on)``. Checks
    that nothing of the killed run survives, that the versions continue above the published one,
    and that the fresh steps after the journalled ones were sampled by the version trained."""
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        cmd = [sys.executable, "-m", "saorl.cli", "train", *args, "--run-dir", str(run_dir)]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    wait_for_steps(proc, run_dir, 3, log, timeout_s=300)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert not wait_until_gone(proc.pid, 30), session_pids(proc.pid)
    before = published(run_dir)

    log2 = tmp_path / "resume.log"
    again = resume_train(run_dir, log=log2)
    assert again.wait(300) == 0, log2.read_text()[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    marker = next(r["resume"] for r in rows if "resume" in r)
    assert marker["from_step"] >= 2 and marker["version"] > before  # one number, one set of weights
    after = [r for r in rows[rows.index(next(r for r in rows if "resume" in r)):] if r.get("step", 0) > 0]
    # the journalled rollouts of before the crash are trained first (stale), then fresh ones (exact)
    assert after and after[-1]["step"] == total and after[-1].get("mismatch/tokens_s0", 0) > 0
    assert_exact(after)
    return before, marker, after
