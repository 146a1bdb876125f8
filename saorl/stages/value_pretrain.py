"""Value pretraining: fit the critic on rollouts of the initial policy, before RL (docs/method.md).

The paper's "scaled value pretraining": a critic initialised from the policy knows nothing about
returns, so the first RL updates would use near-random advantages. Instead, before RL:

1. sample ``value_pretrain.rollouts`` trajectories of the *fixed* initial policy (one per training
   task, at the rollout temperature) with the local engine, set up as the run's local rollout
   engine is (:func:`sampling_model`: ``rollout.engine.dtype``, ``rollout.engine.moe_top_k``,
   ``rollout.engine.router_noise``), so the critic fits the returns of the sampler RL will train on;
2. hold out 20% of them; compute Monte-Carlo returns along the preset's chain
   (``R_k = Σ_{j≥k} γ^{j−k} r_{a_j}``, GAE with λ = 1, independent of V);
3. fit a critic initialised from the policy (frozen attention when the preset says so; with
   ``model.lora.critic`` a LoRA adapter and the head, saved merged into the plain layout) with
   ``0.5 · (V − R)²`` over the chain tokens, on 25%, 50% and 100% of the remaining rollouts
   (only 100% with ``value_pretrain.curve: false``), ``value_pretrain.steps`` minibatch steps
   each, every fit starting from the same initial critic;
4. report the held-out value loss and explained variance per fit (the scaling curve: how much
   the critic gains from more rollouts) and keep the 100% fit.

Departures and choices:
- The chain follows the preset, as the RL critic updates do (``value_targets`` with λ = 1):
  action tokens only with ``skip_observation`` (sao: exactly ``mc_returns`` over ``action_mask``),
  every response token otherwise (vapo), so pretraining fits the very targets RL will use.
- Rollouts use training tasks drawn with a seed of their own (``seed + 15485863``), independent of
  the SFT demonstrations and of the RL task order; a task file shorter than ``rollouts`` is cycled
  (a repeated task gets a different sample).
- With ``rollout.engine`` of a server kind (vLLM, SGLang, ``http``), the rollouts are still sampled by the
  local engine, from the same weights in ``model.dtype`` (the server's own numerics are not
  reproduced).
- Each fit uses a constant learning rate (no warm-up or decay): the fits are short and
  their comparison across data sizes is the point.

:func:`initial_critic` is what a run calls: the result is cached under
``run.out_dir/.cache/critic-<key>``, keyed by everything that determines it, like the SFT warm
start (:mod:`saorl.stages.sft`), so every arm of a comparison starts from the same critic.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from saorl.agent.prompts import fitting_for_run
from saorl.algo.gae import value_targets
from saorl.algo.losses import value_loss
from saorl.algo.registry import AlgoPreset
from saorl.config import SaorlConfig
from saorl.config.engines import LocalEngineConfig
from saorl.data.batch import Batch, collate
from saorl.data.packing import MicroBatch
from saorl.data.tasks import env_sources, load_split
from saorl.data.trajectory import Trajectory
from saorl.engines.base import SamplingParams
from saorl.envs.registry import env_factory_for, env_version_key
from saorl.models.codec import check_vocab, prompt_format_key, run_tokenizer
from saorl.models.critic import Critic
from saorl.models.loading import checkpoint_activations, load_policy, train_dtype
from saorl.models.lora import lora_critic
from saorl.models.packed import honours_shared_prefix, use_varlen_attention
from saorl.models.serialize import save_critic
from saorl.models.shelf import PolicyShelf
from saorl.runtime.backends.messages import RolloutRequest
from saorl.runtime.learner.optimize import Updater, prepare_share, share_of, update
from saorl.runtime.learner.shard_stages import sharded_here
from saorl.runtime.recorder import CountProgress

FRACTIONS: tuple[float, ...] = (0.25, 0.5, 1.0)
"""Fractions of the training rollouts fitted on, one row of the scaling curve each."""
VAL_FRACTION = 0.2
"""Share of the rollouts held out for the validation loss and explained variance."""
METRICS_FILE = "value_pretrain_metrics.json"
_TASK_SEED_OFFSET = 15485863


# ------------------------------------------------------------------------------------- key, cache
def value_pretrain_key(cfg: SaorlConfig, policy_spec: str) -> str:
    """Hash of everything that determines the pretrained critic (16 hex digits)."""
    p, r = cfg.algo.preset, cfg.rollout
    ident = {
        "policy": policy_spec, "tokenizer": cfg.model.tokenizer, "dtype": cfg.model.dtype,
        "env": cfg.env.model_dump(exclude=_unused_env_fields(cfg), exclude_defaults=True), "seed": cfg.seed,
        "rollout": {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                    "max_new_tokens": r.max_new_tokens, "max_total_tokens": r.max_total_tokens},
        "value_pretrain": cfg.value_pretrain.model_dump(exclude={"enabled", "curve"}),
        "gamma": p.gamma, "freeze_critic_attention": p.freeze_critic_attention,
        "skip_observation": p.skip_observation, "grad_clip": cfg.trainer.grad_clip, "format": 1,
        **prompt_format_key(cfg.model), **env_version_key(cfg.env.type),
    }
    if p.critic_train_layers is not None:  # (absent when off: the keys of caches made before stay valid)
        ident["critic_train_layers"] = p.critic_train_layers
    if cfg.model.lora.critic:  # (absent when off, like the sampler's keys below)
        lora = cfg.model.lora
        ident["lora_critic"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                "targets": lora.target_modules}
    e = r.local_engine  # servers: no engine-only knobs
    engine = {"dtype": e.dtype, "moe_top_k": e.moe_top_k, "router_noise": e.router_noise}
    if any(engine.values()):  # (absent when unset: the keys of caches made before stay valid)
        ident["sampler"] = engine
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _unused_env_fields(cfg: SaorlConfig) -> set[str]:
    """Env fields that do not change which training tasks value pretraining sees."""
    train, test = env_sources(cfg.env)
    held_out_of_file = train is not None and test is None
    return {"num_train_tasks"} | (set() if held_out_of_file else {"num_test_tasks"})


def cached_critic_dir(cfg: SaorlConfig, policy_spec: str) -> Path:
    """Where value pretraining keeps the critic it fits for ``policy_spec`` under ``cfg``
    (``run.out_dir/.cache/critic-<key>``; it holds ``critic.json`` once written)."""
    return Path(cfg.run.out_dir) / ".cache" / f"critic-{value_pretrain_key(cfg, policy_spec)}"


def initial_critic(cfg: SaorlConfig, policy_spec: str, log: Callable[[str], None] = print,
                   shelf: PolicyShelf | None = None) -> str | None:
    """The critic directory RL starts from, or None for a critic initialised from the policy.

    None when the preset trains no critic. Otherwise ``cfg.model.critic`` when set; None when
    value pretraining is off (``algo.value_pretrain`` resolves to False, or
    ``value_pretrain.enabled`` is False); else the cached ``run.out_dir/.cache/critic-<key>``,
    pretrained on rollouts of ``policy_spec`` first if it is not there yet (the policy borrowed
    from ``shelf``: it stays there for the run's parts, :mod:`saorl.models.shelf`).
    """
    preset = cfg.algo.preset
    if not preset.use_critic:
        return None
    if cfg.model.critic:
        return cfg.model.critic
    if not (preset.value_pretrain and cfg.value_pretrain.enabled):
        return None
    out = cached_critic_dir(cfg, policy_spec)
    if (out / "critic.json").exists():
        log(f"value pretraining: using the cached critic {out}")
        return str(out)
    run_value_pretrain(cfg, policy_spec, out, log, shelf)
    return str(out)


# ---------------------------------------------------------------------------------------- data
def sampling_model(cfg: SaorlConfig, policy_spec: str, policy: torch.nn.Module) -> torch.nn.Module:
    """The model value pretraining samples with: ``policy`` itself, or — where the run's local
    rollout engine differs from the trainer (``rollout.engine.dtype``, ``rollout.engine.moe_top_k``,
    ``rollout.engine.router_noise``, as :func:`saorl.runtime.backends.worker.build_engine` sets it
    up) — a copy of ``policy_spec`` set up the same way; ``policy`` is never changed."""
    e = cfg.rollout.engine
    differs = isinstance(e, LocalEngineConfig) and (e.dtype not in (None, cfg.model.dtype) or e.perturbed)
    if not differs:
        return policy
    model = load_policy(policy_spec, dtype=e.dtype or cfg.model.dtype, device=cfg.model.device,
                        seed=cfg.seed)
    if e.perturbed:
        from saorl.models.routing import perturb_routing

        perturb_routing(model, top_k=e.moe_top_k, noise_std=e.router_noise, seed=cfg.seed)
    return model


def sample_rollouts(cfg: SaorlConfig, policy, tokenizer, n: int,
                    on_done: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """``n`` trajectories of ``policy`` on training tasks, at the rollout sampling settings;
    ``on_done(done, n)`` as they finish."""
    from saorl.engines.local import LocalEngine
    from saorl.runtime.backends.inprocess import InProcessBackend, run_requests

    env_factory = env_factory_for(cfg.env)
    tasks = load_split(env_factory(), cfg.env, "train", n, cfg.seed + _TASK_SEED_OFFSET)
    if tasks:
        tasks = fitting_for_run(cfg, tasks, env_factory, tokenizer, "value-pretraining tasks")
    if not tasks:
        raise ValueError(f"env {cfg.env.type!r} produced no training tasks for value pretraining")
    r, slots = cfg.rollout, cfg.rollout.local_engine.slots
    engine = LocalEngine.from_config(r.local_engine, policy, tokenizer, device=cfg.model.device)
    try:  # a call past env.call_timeout_s stops value pretraining (RolloutTimeout, exit status 3)
        backend = InProcessBackend(engine, env_factory, tokenizer,
                                   sampling=replace(SamplingParams.of_rollout(cfg.rollout), seed=cfg.seed),
                                   max_total_tokens=r.max_total_tokens, concurrency=2 * slots)
        done = run_requests(backend, [RolloutRequest(i, tasks[i % len(tasks)]) for i in range(n)], on_done)
    finally:
        engine.close()
        env_factory.close()
    return [done[i] for i in range(n)]


def split_rollouts(trajs: Sequence[Trajectory], seed: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """(train, held-out): a seeded shuffle, ``max(1, round(20%))`` held out; needs ≥ 2 rollouts."""
    if len(trajs) < 2:
        raise ValueError(f"value pretraining needs at least 2 rollouts (train + held out), got {len(trajs)}")
    order = list(range(len(trajs)))
    random.Random(seed).shuffle(order)
    n_val = min(len(trajs) - 1, max(1, round(VAL_FRACTION * len(trajs))))
    return [trajs[i] for i in order[n_val:]], [trajs[i] for i in order[:n_val]]


def chain_targets(batch: Batch, preset: AlgoPreset) -> tuple[torch.Tensor, torch.Tensor]:
    """(returns ``[B, T]``, chain mask ``[B, T]``): Monte-Carlo returns on the preset's chain."""
    return value_targets(batch.rewards, None, batch.action_mask, batch.response_mask, gamma=preset.gamma,
                         lam=1.0, skip_observation=preset.skip_observation)


# ------------------------------------------------------------------------------------- fitting
@torch.no_grad()
def critic_metrics(critic: Critic, trajs: Sequence[Trajectory], preset: AlgoPreset, *, pad_id: int,
                   batch_size: int, device: str = "cpu") -> dict[str, float]:
    """Value loss ``0.5·mean (V − R)²`` and explained variance over all chain tokens of ``trajs``."""
    was_training = critic.training
    critic.eval()
    values, returns = [], []
    for i in range(0, len(trajs), batch_size):
        b = collate(trajs[i:i + batch_size], pad_id).to(device)
        r, mask = chain_targets(b, preset)
        v = critic(b.input_ids, b.attention_mask)
        values.append(v[mask.bool()].float().cpu())
        returns.append(r[mask.bool()].float().cpu())
    critic.train(was_training)
    v, r = torch.cat(values)[None], torch.cat(returns)[None]
    _, m = value_loss(v, r, torch.ones_like(v))
    return {"loss": m["critic/value_loss"], "explained_var": m["critic/explained_var"],
            "return_mean": m["critic/return_mean"], "value_mean": m["critic/value_mean"]}


def fit_critic(critic: Critic, trajs: Sequence[Trajectory], preset: AlgoPreset, *, steps: int,
               batch_size: int, lr: float, grad_clip: float, pad_id: int, seed: int,
               device: str = "cpu", max_tokens_per_microbatch: int = 4096, packing: bool = True,
               updater: Updater | None = None, progress: Callable[[int, int], None] | None = None,
               activation_checkpointing: bool = False, shared_prefix: bool = True) -> dict[str, float]:
    """Train ``critic`` in place on ``trajs`` for ``steps`` minibatch steps; last step's metrics.

    Frozen attention per ``preset.freeze_critic_attention`` and only the top
    ``preset.critic_train_layers`` blocks trained when set (frozen parameters never change; the
    frozen blocks below run under ``no_grad``).
    Minibatches of ``min(batch_size, len(trajs))`` distinct rollouts, reshuffled every epoch. Each
    step is the trainer's optimizer routine (:func:`saorl.runtime.learner.optimize.update`): token-budget
    micro-batches as in RL, the minibatch's token-mean value loss, and a step whose loss, gradient
    or updated weights would not be finite skipped (``critic/nonfinite_skips``). With the sharded
    trainer's ``updater`` every rank trains its share of each minibatch. ``progress`` is called
    with ``(steps done, steps)`` after every step (a :class:`CountProgress` prints a line at most
    every 10 s: a real model's fit takes minutes). ``activation_checkpointing``: the trunk's decoder
    layers recompute their activations in the backward pass (``trainer.activation_checkpointing``),
    switched off again when the fit ends.
    """
    if not trajs:
        raise ValueError("fit_critic needs at least one trajectory")
    updater = updater if updater is not None else Updater()
    critic.set_frozen_attention(preset.freeze_critic_attention, preset.critic_train_layers)
    if packing:
        use_varlen_attention(critic.trunk)
    shared_prefix = shared_prefix and packing and honours_shared_prefix(critic.trunk)
    params = critic.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = random.Random(seed)
    order: list[int] = []
    size = min(batch_size, len(trajs))
    metrics: dict[str, float] = {}
    skips = 0
    critic.train()
    if activation_checkpointing:
        checkpoint_activations(critic.trunk)
    for step in range(steps):
        if len(order) < size:  # a new epoch; a short remainder is dropped
            order = list(range(len(trajs)))
            gen.shuffle(order)
        idx, order = order[:size], order[size:]
        mine = updater.share([trajs[i] for i in idx], [len(trajs[i]) for i in idx])
        device = next(critic.parameters()).device
        share = prepare_share(updater, mine, pad_id, device, max_tokens_per_microbatch, packing,
                              shared_prefix)
        returns, mask = chain_targets(share.batch, preset)
        whole = updater.token_total(mask)

        def loss_of(mb: MicroBatch, returns=returns, mask=mask, whole=whole) -> torch.Tensor:
            m = mb.gather(mask)
            values = critic(mb.input_ids, **mb.model_args())
            return value_loss(values, mb.gather(returns), m)[0] * share_of(m, whole)

        total, norm = update(updater, params, opt, share.passes, loss_of, grad_clip)
        skips += norm is None
        metrics = {"critic/value_loss": updater.sum([float(total)])[0] / updater.world,
                   "critic/nonfinite_skips": skips}
        if progress is not None:
            progress(step + 1, steps)
    if activation_checkpointing:
        critic.trunk.activation_checkpointing_disable()
    critic.eval()
    return metrics


# ----------------------------------------------------------------------------------------- run
def run_value_pretrain(cfg: SaorlConfig, policy_spec: str, out_dir: Path,
                       log: Callable[[str], None] = print, shelf: PolicyShelf | None = None) -> dict:
    """Sample rollouts of ``policy_spec``, fit the critic, save it to ``out_dir``; final metrics.

    Writes ``out_dir`` (``save_critic`` layout) and ``out_dir/value_pretrain_metrics.json``
    (``{"final": {...}, "curve": [row, ...]}``, one row per data fraction plus the unfitted
    critic as fraction 0). Returns the ``value_pretrain/*`` metrics of the 100% fit. The caller's
    torch RNG state is left as it was (a cached critic and a fresh one leave a run identical). The
    policy is borrowed from ``shelf`` (read only: sampled with, its trunk copied) and stays there.
    """
    if not cfg.algo.preset.use_critic:
        raise ValueError(f"algorithm {cfg.algo.name!r} has no critic to pretrain")
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        return _pretrain(cfg, policy_spec, Path(out_dir), log, shelf if shelf is not None else PolicyShelf())


def _pretrain(cfg: SaorlConfig, policy_spec: str, out_dir: Path, log: Callable[[str], None],
              shelf: PolicyShelf) -> dict:
    vp, preset = cfg.value_pretrain, cfg.algo.preset
    t0 = time.monotonic()
    tokenizer = run_tokenizer(cfg.model)
    # read only here; it stays on the shelf when the run's trainer wants the same model (not
    # float16's float32 copy, nor a sharded trainer's on the CPU)
    same = train_dtype(cfg.model.dtype) == cfg.model.dtype and cfg.trainer.shard != "fsdp2"
    get = shelf.borrow if same else shelf.take
    policy = get(policy_spec, dtype=cfg.model.dtype, device=cfg.model.device, seed=cfg.seed)
    check_vocab(tokenizer, policy)
    log(f"value pretraining: sampling {vp.rollouts} rollouts of {policy_spec} on {cfg.env.type}")
    with CountProgress("value pretraining rollouts", enabled=cfg.run.progress, log=log) as count:
        trajs = sample_rollouts(cfg, sampling_model(cfg, policy_spec, policy), tokenizer, vp.rollouts, count)
    rollout_s = time.monotonic() - t0
    train, val = split_rollouts(trajs, cfg.seed)
    log(f"value pretraining: {len(trajs)} rollouts in {rollout_s:.0f}s "
        f"(success {sum(t.episode.success for t in trajs) / len(trajs):.2f}); "
        f"fitting on {len(train)}, holding out {len(val)}")
    if len({t.total_reward for t in trajs}) == 1:
        log(f"value pretraining: warning: every rollout earned reward {trajs[0].total_reward:g}; the "
            "critic can only learn that constant (start from a policy that sometimes succeeds, e.g. SFT)")
    kw = dict(pad_id=tokenizer.pad_token_id, device=cfg.model.device)

    def fresh() -> Critic:  # the policy samples in model.dtype, the critic trains in train_dtype
        critic = Critic.from_policy(policy, dtype=train_dtype(cfg.model.dtype), seed=cfg.seed)
        return lora_critic(cfg.model.lora, critic, cfg.seed)

    rows = [_row(0.0, 0, critic_metrics(fresh(), val, preset, batch_size=vp.batch_size, **kw), None)]
    sizes = sorted({max(1, round(f * len(train))) for f in (FRACTIONS if vp.curve else (1.0,))})
    critic = None
    fit_kw = dict(steps=vp.steps, batch_size=vp.batch_size, lr=vp.lr, grad_clip=cfg.trainer.grad_clip,
                  seed=cfg.seed, packing=cfg.trainer.packing, shared_prefix=cfg.trainer.shared_prefix,
                  max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch, **kw)
    for n in sizes:
        critic = fresh()
        if sharded_here(cfg):  # on every rank, sharded as the learner is
            from saorl.runtime.learner.shard_stages import run_sharded

            critic, fit = run_sharded(fit_critic, critic, train[:n], preset, which="critic", **fit_kw)
        else:
            with CountProgress(f"value pretraining fit on {n} rollouts", enabled=cfg.run.progress,
                               log=log) as count:
                fit = fit_critic(critic, train[:n], preset, progress=count,
                                 activation_checkpointing=cfg.trainer.activation_checkpointing, **fit_kw)
        val_m = critic_metrics(critic, val, preset, batch_size=vp.batch_size, **kw)
        rows.append(_row(n / len(train), n, val_m, fit["critic/value_loss"]))
        log(f"value pretraining: {n} rollouts: val loss {val_m['loss']:.4f}, "
            f"val explained var {val_m['explained_var']:.3f}")
    save_critic(critic, out_dir)
    last = rows[-1]
    final = {
        "value_pretrain/rollouts": float(len(trajs)), "value_pretrain/train_rollouts": float(len(train)),
        "value_pretrain/val_rollouts": float(len(val)), "value_pretrain/val_loss": last["val_loss"],
        "value_pretrain/val_explained_var": last["val_explained_var"],
        "value_pretrain/val_loss_unfitted": rows[0]["val_loss"],
        "value_pretrain/train_loss": last["train_loss"], "value_pretrain/return_mean": last["return_mean"],
        "value_pretrain/success_frac": sum(t.episode.success for t in trajs) / len(trajs),
        "value_pretrain/rollout_s": rollout_s, "value_pretrain/elapsed_s": time.monotonic() - t0,
    }
    (out_dir / METRICS_FILE).write_text(json.dumps({"final": final, "curve": rows}, indent=2) + "\n")
    log(format_curve(rows))
    return final


def _row(fraction: float, n: int, val: dict[str, float], train_loss: float | None) -> dict:
    return {"fraction": fraction, "rollouts": n, "val_loss": val["loss"],
            "val_explained_var": val["explained_var"], "return_mean": val["return_mean"],
            "train_loss": train_loss}


def format_curve(rows: Sequence[dict]) -> str:
    """The scaling curve as a small text table (rollouts used, val loss, val explained variance)."""
    lines = [f"{'rollouts':>9} {'fraction':>9} {'val loss':>10} {'val EV':>8} {'train loss':>11}"]
    for r in rows:
        train = "-" if r["train_loss"] is None else f"{r['train_loss']:.4f}"
        lines.append(f"{r['rollouts']:>9} {r['fraction']:>9.2f} {r['val_loss']:>10.4f} "
                     f"{r['val_explained_var']:>8.3f} {train:>11}")
    return "\n".join(lines)
