"""A fingerprint of one fixed-seed in-process run, to show that a refactor changed no result.

Runs SFT, value pretraining and a few synchronous SAO steps on the in-process backend (one
process, no worker timing in the loop, so the run is deterministic), then prints one JSON object:
the SHA-256 of every final weight tensor (policy and critic) and of every logged metric that is not
a time. Run it before and after a change and compare the two outputs; equal objects mean
bit-identical weights and metrics.

    python benchmarks/run_fingerprint.py > before.json
    # ... change the code ...
    python benchmarks/run_fingerprint.py > after.json && cmp before.json after.json
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import tempfile
from pathlib import Path

OVERRIDES = [
    "runtime.backend=inprocess", "runtime.mode=sync", "runtime.trainer_threads=1", "seed=3",
    "trainer.steps=6", "trainer.policy_lr=1e-4", "trainer.critic_lr=1e-3",
    "sft.steps=150", "sft.num_demos=256", "sft.batch_size=16",
    "value_pretrain.rollouts=24", "value_pretrain.steps=5", "value_pretrain.batch_size=8",
    "run.eval_every=3", "run.eval_tasks=4", "env.num_test_tasks=4", "run.progress=false",
    "rollout.concurrent_episodes=1", "rollout.engine.slots=1",
    "rollout.max_new_tokens=48", "rollout.max_total_tokens=128",
]
TIME_WORDS = ("time", "_s", "per_s", "wall", "elapsed", "throughput", "tokens_per", "sec")


def _is_time(key: str) -> bool:
    return any(w in key for w in TIME_WORDS)


def _tensor_digests(directory: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        for name, t in sorted(load_file(str(f)).items()):
            data = t.contiguous().view(-1).numpy().tobytes()
            out[f"{directory.name}/{name}"] = hashlib.sha256(data).hexdigest()[:16]
    return out


def main() -> int:
    from saorl.config import load_config
    from saorl.training import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*OVERRIDES, f"run.out_dir={tmp}/out"])
        with contextlib.redirect_stdout(sys.stderr):  # stdout: the fingerprint alone, so two compare
            run_dir, _ = train(cfg, f"{tmp}/run")
        run_dir = Path(run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        metrics = [{k: v for k, v in sorted(r.items()) if not _is_time(k)} for r in rows]
        digest = {
            "weights": {**_tensor_digests(run_dir / "final" / "policy"),
                        **_tensor_digests(run_dir / "final" / "critic")},
            "metrics_sha256": hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest(),
            "metric_rows": len(metrics),
            "metric_keys": sorted({k for r in metrics for k in r}),
            "last_row": metrics[-1] if metrics else {},
        }
        if len(sys.argv) > 1:  # the whole metrics, for finding where two runs part
            Path(sys.argv[1]).write_text("\n".join(json.dumps(m, sort_keys=True) for m in metrics) + "\n")
    print("FINGERPRINT " + json.dumps(digest, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
