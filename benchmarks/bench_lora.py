"""Full fine-tuning vs LoRA (rank 8 and 16), side by side: what trains, what it costs, what it publishes.

    python benchmarks/bench_lora.py                                  # tiny-dense, tiny-moe, qwen3-h512
    python benchmarks/bench_lora.py --models tiny-moe --steps 5 --publishes 5

For each model, three learners on the same base (seed 0): the full policy trainable, and a LoRA
adapter of rank 8 and of rank 16 (alpha 16, the default targets: attention and MLP projections the
policy has; :func:`saorl.models.lora.attach_lora`, as ``model.lora`` does). Each is a
:class:`saorl.runtime.learner.single.Learner` of the ``sao`` preset, with a critic copied from the plain
policy before the adapter is attached (as :func:`saorl.runtime.parts.build_learner`'s caller does),
so the critic's cost — the same in every column — is part of each step. Measured:

- trainable policy parameters (what the policy's optimizer holds);
- policy optimizer state: the bytes of AdamW's tensors (``exp_avg``, ``exp_avg_sq``, ``step``)
  after the steps;
- ``Learner.step`` time: the median of ``--steps`` steps after one warm-up step, on fixed
  trajectories (``--batch`` of them, multi-turn, their rollout log-probs the base policy's own, so
  every ratio starts at 1), the three learners stepped in turn so a load spike hits them alike;
- publication (``Learner.publish`` to a :class:`saorl.runtime.weights.files.FilePublisher`: the whole
  state dict, or the adapter alone): median seconds of ``--publishes``, interleaved, and the bytes
  one version takes on disk.

Models: ``tiny-dense`` and ``tiny-moe`` (:mod:`saorl.models.tiny`), and ``qwen3-h512``: the
tiny-dense config made wider and deeper (hidden 512, 8 heads of 64, 4 KV heads, MLP 1536, 6
layers; 19.4M parameters), the largest whose steps still fit the run in minutes on a 2-core CPU
(``--steps 5 --publishes 5`` took 11 minutes there, shared with other jobs).
Prints a Markdown table and the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from saorl.algo.registry import get_preset
from saorl.config.sections import LORA_TARGETS
from saorl.data.batch import collate
from saorl.data.trajectory import Episode, Trajectory
from saorl.models.critic import Critic
from saorl.models.logprobs import token_logprobs
from saorl.models.lora import attach_lora
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import Learner, OptimConfig
from saorl.runtime.weights.files import FilePublisher, FileSource

PAD = 1
BIG = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
           intermediate_size=1536, num_hidden_layers=6)
"""``qwen3-h512``: overrides of the tiny-dense config."""
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "tiny-dense": lambda: build_tiny("tiny-dense", seed=0),
    "tiny-moe": lambda: build_tiny("tiny-moe", seed=0),
    "qwen3-h512": lambda: build_tiny("tiny-dense", seed=0, **BIG),
}


def trajectories(n: int, seed: int = 0) -> list[Trajectory]:
    """``n`` two-turn trajectories: a prompt of 48-64 tokens, actions of 24-40, an observation of
    8-16 between them, a reward of 0 or 1 on the last token; rollout log-probs filled in later."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, a1, o, a2 = rng.randint(48, 64), rng.randint(24, 40), rng.randint(8, 16), rng.randint(24, 40)
        ids = [rng.randint(2, 1023) for _ in range(p + a1 + o + a2)]
        mask = [0] * p + [1] * a1 + [0] * o + [1] * a2
        rewards = [0.0] * len(ids)
        rewards[-1] = float(rng.random() < 0.5)
        out.append(Trajectory(ids, mask, [0.0] * len(ids), rewards, [0 if m else -1 for m in mask], p,
                              task_id=f"t{i}", episode=Episode(success=rewards[-1] > 0)))
    return out


def with_own_logprobs(policy: torch.nn.Module, trajs: list[Trajectory]) -> list[Trajectory]:
    """``trajs`` with rollout log-probs equal to ``policy``'s (the base's: every DIS ratio starts at 1)."""
    b = collate(trajs, PAD)
    with torch.no_grad():
        lp = token_logprobs(policy, b.input_ids, b.attention_mask)
    out = []
    for i, t in enumerate(trajs):
        lps = [float(lp[i, j]) if m else 0.0 for j, m in enumerate(t.action_mask)]
        out.append(Trajectory(t.token_ids, t.action_mask, lps, t.rewards, t.versions, t.prompt_len, t.task_id,
                              episode=t.episode))
    return out


def learner(build: Callable[[], torch.nn.Module], rank: int | None) -> Learner:
    """A ``sao`` learner on a fresh base: full fine-tuning (``rank`` None) or a LoRA adapter."""
    policy = build()
    critic = Critic.from_policy(policy, seed=0)  # before the adapter; the default critic design
    if rank is not None:
        policy = attach_lora(policy, rank=rank, alpha=16.0, dropout=0.0, targets=list(LORA_TARGETS),
                             optional=LORA_TARGETS, base={"policy": "bench", "seed": 0})
    return Learner(policy.train(), critic, get_preset("sao"), OptimConfig(policy_lr=1e-4, critic_lr=1e-4),
                   pad_id=PAD)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt``'s state."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def dir_bytes(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def measure(name: str, steps: int, publishes: int, batch: int) -> dict[str, dict[str, float]]:
    build = MODELS[name]
    variants = {"full": None, "LoRA r8": 8, "LoRA r16": 16}
    lrns = {v: learner(build, r) for v, r in variants.items()}
    trajs = with_own_logprobs(build().train(), trajectories(batch, seed=1))
    step_s: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(steps + 1):  # round 0: warm-up
        for v, lrn in lrns.items():
            t0 = time.perf_counter()
            lrn.step(trajs)
            if i:
                step_s[v].append(time.perf_counter() - t0)
    out = {v: {"params": sum(p.numel() for p in lrn.policy_params), "opt_bytes": state_bytes(lrn.policy_opt),
               "step_s": statistics.median(step_s[v])} for v, lrn in lrns.items()}
    out["full"]["model_params"] = sum(p.numel() for p in lrns["full"].policy.parameters())
    with tempfile.TemporaryDirectory() as d:
        syncs = {v: FilePublisher(Path(d) / f"w{k}") for k, v in enumerate(variants)}
        pub_s: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(publishes + 1):
            for v, lrn in lrns.items():
                lrn.version = 1000 + i  # a fresh version each time, as after a step
                t0 = time.perf_counter()
                lrn.publish(syncs[v])
                if i:
                    pub_s[v].append(time.perf_counter() - t0)
        for v in variants:
            out[v]["publish_s"] = statistics.median(pub_s[v])
            out[v]["publish_bytes"] = dir_bytes(Path(FileSource(syncs[v].dir).latest()[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=10, help="timed Learner.step calls per learner")
    ap.add_argument("--publishes", type=int, default=10, help="timed publications per learner")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    print(f"# sao Learner.step on {args.batch} trajectories, median of {args.steps} steps; publication: "
          f"median of {args.publishes}; {args.threads} torch thread(s); load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    print("| model (parameters) | policy | trainable policy params | policy optimizer state | "
          "Learner.step | publish | bytes per version |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        m = measure(name, args.steps, args.publishes, args.batch)
        full = m["full"]
        for v, r in m.items():
            label = f"{name} ({full['model_params'] / 1e6:.1f}M)" if v == "full" else ""
            ratio = "" if v == "full" else f" ({full['publish_bytes'] / r['publish_bytes']:.0f}× fewer)"
            print(f"| {label} | {v} | {r['params']:,} | {r['opt_bytes'] / 2**20:.2f} MiB | "
                  f"{r['step_s'] * 1e3:.0f} ms ({r['step_s'] / full['step_s']:.2f}×) | "
                  f"{r['publish_s'] * 1e3:.1f} ms | {r['publish_bytes']:,}{ratio} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
