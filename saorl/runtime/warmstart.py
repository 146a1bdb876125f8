"""The policy an RL run starts from: the configured one, or its SFT warm start (cached).

Supervised fine-tuning on the env's demonstrations is what turns a freshly initialised tiny
model into an agent that knows the action format and succeeds part of the time; RL then has
something to improve. The SFT result is keyed by everything that determines it (policy,
tokenizer, env, seed, SFT settings) and cached under ``run.out_dir/.cache/sft-<key>``, so every
arm of a comparison starts from the very same SFT model and a second run skips the work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from saorl.config import SaorlConfig
from saorl.envs.registry import load_tasks, make_env_factory
from saorl.models.checkpoint import export_policy
from saorl.models.loading import load_policy
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.sft import SFTConfig, demonstrations, sft


def sft_seed(cfg: SaorlConfig) -> int:
    """The seed of the demonstrations and of SFT: ``sft.seed``, else the run's."""
    return cfg.seed if cfg.sft.seed is None else cfg.sft.seed


def sft_key(cfg: SaorlConfig) -> str:
    ident = {
        "policy": cfg.model.policy, "tokenizer": cfg.model.tokenizer, "dtype": cfg.model.dtype,
        "env": cfg.env.model_dump(), "seed": sft_seed(cfg),
        "sft": cfg.sft.model_dump(exclude={"enabled", "seed"}),
        "format": 1,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_sft(cfg: SaorlConfig, out_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Fine-tune ``cfg.model.policy`` on demonstrations and export it to ``out_dir``."""
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    seed = sft_seed(cfg)
    policy = load_policy(cfg.model.policy, dtype=cfg.model.dtype, device=cfg.model.device, seed=seed)
    env_factory = make_env_factory(cfg.env.type, cfg.env.options)
    tasks = load_tasks(env_factory(), "train", cfg.sft.num_demos, seed + 7919, cfg.env.tasks_file)
    log(f"sft: generating {len(tasks)} demonstrations of {cfg.env.type}")
    demos = demonstrations(env_factory, tasks, tokenizer, seed)
    success = sum(bool(d.metadata.get("success")) for d in demos) / len(demos)
    s = cfg.sft
    sft_cfg = SFTConfig(steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=seed)

    def on_step(step: int, m: dict) -> None:
        if step % 50 == 0 or step == s.steps:
            log(f"sft: step {step}/{s.steps} loss {m['sft/loss']:.4f} ({m['sft/elapsed_s']:.0f}s)")

    metrics = sft(policy, demos, tokenizer.pad_token_id, sft_cfg, on_step=on_step)
    export_policy(policy, tokenizer, out_dir)
    metrics |= {"sft/demos": len(demos), "sft/demo_success_frac": success}
    (out_dir / "sft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def initial_policy(cfg: SaorlConfig, log: Callable[[str], None] = print) -> str:
    """The policy spec RL starts from: ``cfg.model.policy``, or its cached SFT warm start."""
    if not cfg.sft.enabled:
        return cfg.model.policy
    out = Path(cfg.run.out_dir) / ".cache" / f"sft-{sft_key(cfg)}"
    if (out / "config.json").exists():
        log(f"sft: using the cached warm start {out}")
        return str(out)
    run_sft(cfg, out, log)
    return str(out)
