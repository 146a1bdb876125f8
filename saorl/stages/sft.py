"""Warm start: supervised fine-tuning of the initial policy on an env's demonstrations (cached).

Supervised fine-tuning on the env's demonstrations is what turns a freshly initialised tiny
model into an agent that knows the action format and succeeds part of the time; RL then has
something to improve. Demonstrations are played through the very same agent loop as rollouts
(a scripted engine "samples" the demonstration's actions), so the SFT data has the exact
multi-turn token layout RL will see. The loss is the mean negative log-likelihood of the
**action tokens only** (prompt and observation tokens are context, never targets).

The result is keyed by everything that determines it (policy, tokenizer, env, seed, SFT
settings) and cached under ``run.out_dir/.cache/sft-<key>``, so every arm of a comparison
starts from the very same SFT model and a second run skips the work.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from saorl.algo.losses import masked_mean
from saorl.config import SaorlConfig
from saorl.data.packing import MicroBatch
from saorl.data.task import Task
from saorl.data.tasks import load_split
from saorl.data.trajectory import Trajectory
from saorl.envs.registry import env_factory_for, env_version_key
from saorl.models.codec import check_vocab, prompt_format_key, run_tokenizer
from saorl.models.loading import checkpoint_activations, train_dtype
from saorl.models.logprobs import token_logprobs
from saorl.models.packed import honours_shared_prefix, use_varlen_attention
from saorl.models.serialize import export_policy
from saorl.models.shelf import PolicyShelf
from saorl.runtime.learner.optimize import Updater, prepare_share, share_of, update
from saorl.runtime.learner.shard_stages import sharded_here
from saorl.runtime.recorder import PROGRESS_EVERY_S, CountProgress

WARMUP_STEPS = 20
"""Linear learning-rate warm-up of SFT, then cosine decay to 0."""


def demonstrations(env_factory: Callable, tasks: list[Task], tokenizer, seed: int,
                   concurrency: int = 8,
                   on_done: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """One demonstration trajectory per task (deterministic in ``seed``); ``on_done(done, total)``
    as they finish."""
    from saorl.agent.scripted import demonstration_trajectory

    rngs = [random.Random(f"{seed}:{t.id}") for t in tasks]  # independent of completion order

    async def _all() -> list[Trajectory]:
        sem = asyncio.Semaphore(concurrency)

        done = 0

        async def one(task: Task, rng: random.Random) -> Trajectory:
            nonlocal done
            async with sem:
                traj = await demonstration_trajectory(env_factory(), task, tokenizer, rng)
            done += 1
            if on_done is not None:
                on_done(done, len(tasks))
            return traj

        return list(await asyncio.gather(*(one(t, r) for t, r in zip(tasks, rngs))))

    return asyncio.run(_all())


def lr_at(step: int, steps: int, lr: float, warmup: int = WARMUP_STEPS) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def sft(policy: torch.nn.Module, demos: list[Trajectory], pad_id: int, *, steps: int, batch_size: int,
        lr: float, seed: int, warmup_steps: int = WARMUP_STEPS, grad_clip: float = 1.0,
        on_step: Callable[[int, dict], None] | None = None, max_tokens_per_microbatch: int = 4096,
        packing: bool = True, updater: Updater | None = None,
        activation_checkpointing: bool = False, shared_prefix: bool = True) -> dict[str, float]:
    """Train ``policy`` in place on ``demos`` for ``steps`` AdamW steps; return the last step's metrics.

    Minibatches of ``batch_size`` demonstrations, reshuffled (seeded) every epoch. Each step is the
    trainer's optimizer routine (:func:`saorl.runtime.learner.optimize.update`): token-budget micro-batches
    (``max_tokens_per_microbatch``, ``packing``, ``shared_prefix``, as RL's), gradients accumulated
    to the minibatch's
    token mean, and a step whose loss, gradient or updated weights would not be finite skipped
    (counted in ``sft/nonfinite_skips``). With the sharded trainer's ``updater`` every rank trains
    its share of each minibatch (every rank holds ``demos``). ``activation_checkpointing``
    (``trainer.activation_checkpointing``): each decoder layer's activations are recomputed in the
    backward pass instead of kept, switched off again when SFT ends.
    """
    if not demos:
        raise ValueError("sft needs at least one demonstration")
    updater = updater if updater is not None else Updater()
    device = next(policy.parameters()).device
    if packing:
        use_varlen_attention(policy)
    shared_prefix = shared_prefix and packing and honours_shared_prefix(policy)
    gen = random.Random(seed)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order: list[int] = []
    metrics: dict[str, float] = {}
    skips = 0
    policy.train()
    if activation_checkpointing:
        checkpoint_activations(policy)
    t0 = time.monotonic()
    for step in range(steps):
        if len(order) < batch_size:
            more = list(range(len(demos)))
            gen.shuffle(more)
            order += more
        idx, order = order[:batch_size], order[batch_size:]
        mine = updater.share([demos[i] for i in idx], [len(demos[i]) for i in idx])
        share = prepare_share(updater, mine, pad_id, device, max_tokens_per_microbatch, packing,
                              shared_prefix)
        batch = share.batch
        whole = updater.token_total(batch.action_mask)

        def loss_of(mb: MicroBatch, batch=batch, whole=whole) -> torch.Tensor:
            mask = mb.gather(batch.action_mask)
            logprobs = token_logprobs(policy, mb.input_ids, **mb.model_args())
            return -masked_mean(logprobs, mask) * share_of(mask, whole)

        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup_steps)
        total, norm = update(updater, params, opt, share.passes, loss_of, grad_clip)
        skips += norm is None
        loss = updater.sum([float(total)])[0] / updater.world
        metrics = {"sft/loss": loss, "sft/grad_norm": math.nan if norm is None else norm,
                   "sft/lr": opt.param_groups[0]["lr"], "sft/nonfinite_skips": skips,
                   "sft/elapsed_s": time.monotonic() - t0}
        if on_step is not None:
            on_step(step + 1, metrics)
    if activation_checkpointing:
        policy.activation_checkpointing_disable()
    policy.eval()
    return metrics


# ------------------------------------------------------------------------------ the warm start
def sft_seed(cfg: SaorlConfig) -> int:
    """The seed of the demonstrations and of SFT: ``sft.seed``, else the run's."""
    return cfg.seed if cfg.sft.seed is None else cfg.sft.seed


def sft_key(cfg: SaorlConfig) -> str:
    ident = {
        "policy": cfg.model.policy, "tokenizer": cfg.model.tokenizer, "dtype": cfg.model.dtype,
        "env": _env_key(cfg), "seed": sft_seed(cfg),
        "sft": cfg.sft.model_dump(exclude={"enabled", "seed"}),
        "format": 1, **prompt_format_key(cfg.model), **env_version_key(cfg.env.type),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _env_key(cfg: SaorlConfig) -> dict:
    """The env's settings less the options that change only its reward (``Env.reward_only_options``):
    the demonstrations do not depend on them; and less the options written out at the value the
    env's class takes by default, so ``env.options.X=<its default>`` keys the same SFT as leaving
    it out (as ``exclude_defaults`` does for the env's own fields)."""
    from saorl.envs.registry import resolve_env

    env = cfg.env.model_dump(exclude_defaults=True)
    options = env.get("options")
    if cfg.env.type and isinstance(options, dict):
        cls = resolve_env(cfg.env.type)
        drop = set(cls.reward_only_options)
        defaults = _option_defaults(cls)
        env["options"] = {k: v for k, v in options.items()
                          if k not in drop and not (k in defaults and _same(defaults[k], v))}
        if not env["options"]:
            del env["options"]
    return env


def _option_defaults(cls: type) -> dict:
    """The defaults of the env class's options (:func:`~saorl.stages.env_check.option_params`)."""
    from saorl.stages.env_check import option_params

    try:
        params = option_params(cls)
    except (TypeError, ValueError):  # no signature to read
        return {}
    return {p.name: p.default for p in params if p.default is not p.empty}


def _same(default, value) -> bool:
    """Whether a written option equals its default as the key would see it (a tuple default and a
    list from YAML are the same setting; a default that is not plain data never matches)."""
    default, value = (list(x) if isinstance(x, tuple) else x for x in (default, value))
    try:
        return type(default) is type(value) and bool(default == value)
    except Exception:  # an object whose == is not a plain comparison
        return False


def run_sft(cfg: SaorlConfig, out_dir: Path, log: Callable[[str], None] = print,
            shelf: PolicyShelf | None = None) -> dict:
    """Fine-tune ``cfg.model.policy`` on demonstrations of training tasks and export it to ``out_dir``.

    With a ``shelf``, the policy is taken from it (held there by an earlier phase, or loaded), and
    the fine-tuned one is put on it as what ``out_dir`` loads (not when sharded: each rank trained
    its shards), so the next phase does not read it back from disk (:mod:`saorl.models.shelf`)."""
    shelf = shelf if shelf is not None else PolicyShelf()
    tokenizer = run_tokenizer(cfg.model)
    seed = sft_seed(cfg)
    # sharded: the whole model stays on the CPU; each rank's shards go to its device
    device = "cpu" if sharded_here(cfg) else cfg.model.device
    policy = shelf.take(cfg.model.policy, dtype=train_dtype(cfg.model.dtype), device=device, seed=seed)
    loaded_attention = policy.config._attn_implementation  # sft switches it to packed sequences
    check_vocab(tokenizer, policy)
    env_factory = env_factory_for(cfg.env, deadline=False)
    tasks = load_split(env_factory(), cfg.env, "train", cfg.sft.num_demos, seed + 7919)
    log(f"sft: generating {len(tasks)} demonstrations of {cfg.env.type}")
    # a bar on a terminal, else a line every 10 s: on a loaded machine this takes minutes
    with CountProgress("sft: demonstrations", enabled=cfg.run.progress, log=log) as count:
        demos = demonstrations(env_factory, tasks, tokenizer, seed, on_done=count)
    success = sum(d.episode.success for d in demos) / len(demos)
    s = cfg.sft

    last_line = [0.0]  # elapsed_s of the last line: one every 50 steps, or every 10 s on a real model

    def on_step(step: int, m: dict) -> None:
        bar(step, s.steps)
        if step % 50 == 0 or step == s.steps or m["sft/elapsed_s"] - last_line[0] >= PROGRESS_EVERY_S:
            last_line[0] = m["sft/elapsed_s"]
            log(f"sft: step {step}/{s.steps} loss {m['sft/loss']:.4f} ({m['sft/elapsed_s']:.0f}s)")

    # a bar on a terminal; the lines above are the progress otherwise
    kwargs = dict(steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=seed, packing=cfg.trainer.packing,
                  max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
                  shared_prefix=cfg.trainer.shared_prefix)
    with CountProgress("sft", enabled=cfg.run.progress, every_s=math.inf) as bar:
        if sharded_here(cfg):  # on every rank, sharded as the learner is
            from saorl.runtime.learner.shard_stages import run_sharded

            pad = tokenizer.pad_token_id
            policy, metrics = run_sharded(sft, policy, demos, pad, which="policy", **kwargs)
            on_step(s.steps, metrics)
        else:  # (the sharded learner checkpoints its own way: not in its stages yet)
            metrics = sft(policy, demos, tokenizer.pad_token_id, on_step=on_step,
                          activation_checkpointing=cfg.trainer.activation_checkpointing, **kwargs)
    export_policy(policy, tokenizer, out_dir)
    if not sharded_here(cfg):
        shelf.put(str(out_dir), policy, attn_implementation=loaded_attention)
    metrics |= {"sft/demos": len(demos), "sft/demo_success_frac": success}
    (out_dir / "sft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def warm_start(cfg: SaorlConfig, log: Callable[[str], None] = print, shelf: PolicyShelf | None = None) -> str:
    """The policy spec RL starts from: ``cfg.model.policy``, or its cached SFT warm start (trained
    now if need be, and then held on ``shelf`` for the phases after this one)."""
    if not cfg.sft.enabled:
        return cfg.model.policy
    out = cached_sft_dir(cfg)
    if (out / "config.json").exists():
        log(f"sft: using the cached warm start {out}")
        return str(out)
    run_sft(cfg, out, log, shelf)
    return str(out)


def reuse_cached_sft(cfg: SaorlConfig, elsewhere: Path, log: Callable[[str], None] = print) -> bool:
    """Link the SFT warm start of ``cfg`` from the cache directory ``elsewhere`` (another
    ``run.out_dir/.cache``, such as ``saorl train``'s ``runs/.cache``) into ``cfg``'s own cache when
    it has the same key there and not here: the same settings give the same model, so it is not
    trained again. Files are hard-linked where the filesystem allows (no copy), else copied; never
    written in place afterwards (every write replaces a file whole). Returns whether it did."""
    from saorl.atomic import atomic_dir

    here = cached_sft_dir(cfg)
    there = Path(elsewhere) / here.name
    if (here / "config.json").exists() or not (there / "config.json").exists() or here == there:
        return False
    with atomic_dir(here) as tmp:
        for f in there.rglob("*"):
            dst = tmp / f.relative_to(there)
            if f.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, dst)
            except OSError:
                shutil.copy2(f, dst)
    log(f"sft: reusing the warm start with the same settings from {there}")
    return True


def cached_sft_dir(cfg: SaorlConfig) -> Path:
    """Where the SFT warm start of ``cfg`` is (or would be) cached."""
    return Path(cfg.run.out_dir) / ".cache" / f"sft-{sft_key(cfg)}"


def initial_policy_spec(cfg: SaorlConfig) -> str:
    """The policy a run of ``cfg`` started from: its cached SFT warm start if present, else
    ``model.policy`` (SFT is never run here)."""
    cached = cached_sft_dir(cfg)
    return str(cached) if cfg.sft.enabled and (cached / "config.json").is_file() else cfg.model.policy
