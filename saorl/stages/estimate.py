"""The start-up estimate: each phase's wall clock, from a short calibration on this machine.

A run of a real model spends minutes in phases whose length a user cannot guess from a config
(an SFT warm start, value pretraining's rollouts and fits, the evaluations, the RL steps), and a
default sized for a tiny model can mean hours on a real one. So ``saorl train`` times, before any
phase starts, three things with the policy itself (:func:`calibrate`, a few seconds on a 135M
model on a CPU):

- a forward + backward pass of the policy in its training dtype over a batch of each training
  phase's shape (SFT, the critic fits, an RL step): timed as it is for a small model, whose cost
  a pass counts as much as its cost a token; for a large one (a pass over one trajectory of
  :data:`CHEAP_PASS_S` or more) one trajectory is timed and scaled by the tokens of the batch;
- one AdamW step over the policy's weights (``opt``);
- one decode step of ``slots`` rows with a KV cache (``decode``), and the prefill per token:
  the trainer's local engine, which evaluations and value pretraining decode with whatever
  ``rollout.engine`` is, and the rollouts too when it is ``local`` (a server's generation is not
  timed: it runs elsewhere).

:func:`phase_estimates` turns them into seconds per phase with the run's sizes and a trajectory
shape read from the env (the mean prompt tokens of a few training tasks, its turns, the token
budgets; SFT's from a few demonstrations), the rollouts' replies taken as long as
``rollout.max_new_tokens`` allows (so those phases are usually shorter: a model that answers in
10 tokens of 24 generates for less than half the estimate):

- generation of ``n`` episodes: ``max(n / slots, 1) · A · decode + n · P · prefill`` (``A``
  generated tokens an episode, ``P`` prompt tokens), the local engine's continuous batching;
- the critic (a copy of the trunk without the vocabulary projection) costs :data:`CRITIC_PASS` of
  the policy's pass, its forward pass :data:`CRITIC_FORWARD`;
- an RL step: the policy's pass + ``K`` critic passes + two critic forward passes (values before
  and after), ``1 + K`` optimizer steps; and the generation of its batch, added to the training
  when the trainer's and the workers' threads share the cores, else the longer of the two
  (a pipeline goes at its slowest stage).

The estimate is printed as a table and written to ``RUN/estimate.json`` (the calibration, the
shape and each phase's seconds), where it can be held against what the run then took.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from saorl.agent.tool_turns import with_tools
from saorl.config import SaorlConfig
from saorl.config.engines import LocalEngineConfig
from saorl.data.tasks import load_split
from saorl.engines.base import SamplingParams
from saorl.engines.local import LocalEngine
from saorl.envs.base import Progress
from saorl.envs.registry import env_factory_for
from saorl.models.codec import run_tokenizer
from saorl.models.loading import checkpoint_activations, load_policy, sync_device, train_dtype
from saorl.models.shelf import PolicyShelf

PROMPTS_READ = 4
"""Training tasks whose prompts are tokenized for the mean prompt length."""

CHEAP_PASS_S = 0.25
"""A policy whose forward + backward pass over one trajectory takes less is timed on each phase's
batch as it is (its cost a pass counts as much as its cost a token); a larger one is timed on one
trajectory and scaled."""

CRITIC_PASS = 0.6
"""A critic's forward + backward pass as a fraction of the policy's: the critic has no vocabulary
projection and log-softmax and (attention frozen) no attention weight gradients. Measured on
SmolLM2-135M at 4 × 160 tokens, one thread: 4.7 to 5.3 s against the policy's 8.0 to 9.8 s."""

CRITIC_FORWARD = 0.25
"""A critic's forward pass (its values) as a fraction of the policy's forward + backward pass
(the same measurement: 1.6 to 2.1 s)."""


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` timed here (seconds)."""

    sft_pass: float | None
    """A forward + backward pass of the policy over an SFT batch (None: no SFT)."""
    fit_pass: float
    """... over a value-pretraining fit's batch of rollouts."""
    rl_pass: float
    """... over an RL step's batch of trajectories."""
    per_token: float
    """... over one rollout, a token (what the passes of a large model are scaled from)."""
    opt: float
    """One AdamW step over every policy weight."""
    decode: float
    """One decode step of ``slots`` rows on the trainer's local engine."""
    prefill_per_token: float
    slots: int
    took_s: float
    rl_generation: bool = True
    """The rollouts decode on a local engine (False: on servers, not timed)."""


@dataclass(frozen=True)
class Shape:
    """A trajectory as the token budgets allow it: ``prompt`` tokens, ``turns`` turns,
    ``generated`` tokens sampled an episode, ``tokens`` in all; ``demo_tokens``: the mean tokens
    of a demonstration (SFT's trajectories; None without SFT) and ``demo_s`` the seconds one took
    to make."""

    prompt: float
    turns: int
    generated: int
    tokens: float
    demo_tokens: float | None = None
    demo_s: float | None = None


def trajectory_shape(cfg: SaorlConfig) -> Shape:
    """The run's trajectory shape: the mean prompt tokens of up to :data:`PROMPTS_READ` training
    tasks, the env's turns, and what ``rollout.max_new_tokens`` / ``max_total_tokens`` allow."""
    factory = env_factory_for(cfg.env, deadline=False)
    env = factory()
    tasks = load_split(env, cfg.env, "train", PROMPTS_READ, cfg.seed)
    tokenizer = run_tokenizer(cfg.model)
    lengths = [len(codec.prompt_ids(prompt)) for codec, prompt in
               (with_tools(env, tokenizer, factory().reset(t, Progress())) for t in tasks)]
    prompt = sum(lengths) / max(1, len(lengths))
    budget = cfg.rollout.max_total_tokens
    generated = int(max(1, min(env.max_turns * cfg.rollout.max_new_tokens, budget - prompt)))
    demo = demo_s = None
    if cfg.sft.enabled:
        from saorl.stages.sft import demonstrations

        t = time.perf_counter()
        demos = demonstrations(factory, tasks, tokenizer, cfg.seed)
        demo_s = (time.perf_counter() - t) / max(1, len(demos))
        demo = sum(len(d.token_ids) for d in demos) / max(1, len(demos))
    return Shape(prompt=prompt, turns=env.max_turns, generated=generated,
                 tokens=min(budget, prompt + generated), demo_tokens=demo, demo_s=demo_s)


def calibrate(cfg: SaorlConfig, policy_spec: str, shape: Shape,
              shelf: PolicyShelf | None = None) -> Calibration:
    """Time a forward + backward pass, an AdamW step and (local engine) decode steps of the policy
    ``policy_spec``; the global RNG is left as it was (on a GPU, its generator too). With a
    ``shelf``, the policy is borrowed from it (loaded and held there for the phases after, which
    then do not load it again: :mod:`saorl.models.shelf`) and left as a load is: its AdamW step has a
    zero learning rate (bit for bit no change), its gradients are dropped, its mode is eval."""
    t0 = time.perf_counter()
    device = cfg.model.device
    gpu = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=gpu):
        torch.manual_seed(cfg.seed)
        get = shelf.borrow if shelf is not None else load_policy
        model = get(policy_spec, dtype=train_dtype(cfg.model.dtype), device=device, seed=cfg.seed)
        vocab = model.config.vocab_size
        n = max(8, int(shape.tokens))
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (1, 16), device=device))  # kernels set up once
        model.train()
        if cfg.trainer.activation_checkpointing:  # time the passes as the run makes them, and keep
            checkpoint_activations(model)  # a long sequence's activations as small as the run does
        one = _time_pass(model, 1, n, vocab, device)
        one = min(one, _time_pass(model, 1, n, vocab, device))  # the first pass of a shape is slower
        cheap = one < CHEAP_PASS_S

        def timed(rows: int, tokens: float) -> float:  # a small model's pass as it is, best of 2
            t = int(max(8, tokens))
            if not cheap:
                return rows * t * one / n
            return min(_time_pass(model, rows, t, vocab, device) for _ in range(2))

        vp, sft = cfg.value_pretrain, cfg.sft
        sft_pass = timed(sft.batch_size, shape.demo_tokens or n) if sft.enabled else None
        fit_pass = timed(vp.batch_size, n)
        rl_pass = timed(cfg.trainer.batch_size, n)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=0.0)
        opt.step()  # the first step allocates the moments
        sync_device(device)
        t = time.perf_counter()
        opt.step()
        sync_device(device)
        opt_s = 0.0 if cfg.model.lora.enabled else time.perf_counter() - t  # LoRA: an adapter's step
        del opt
        model.zero_grad(set_to_none=True)
        if cfg.trainer.activation_checkpointing:
            model.activation_checkpointing_disable()  # the shelf's policy left as loaded
        model.eval()
        slots = min(cfg.rollout.local_engine.slots, cfg.rollout.concurrent_episodes)
        decode, prefill = _time_decode(cfg, model, slots, max(1, int(shape.prompt)), vocab)
    model = None  # freed before the phases (or on the shelf, for them)
    if gpu:
        torch.cuda.empty_cache()  # the memory back to the rollout workers on this GPU
    return Calibration(sft_pass=sft_pass, fit_pass=fit_pass, rl_pass=rl_pass, per_token=one / n, opt=opt_s,
                       decode=decode, prefill_per_token=prefill, slots=slots, took_s=time.perf_counter() - t0,
                       rl_generation=isinstance(cfg.rollout.engine, LocalEngineConfig))


def _time_pass(model, rows: int, n: int, vocab: int, device) -> float:
    """Seconds of a forward + backward pass of ``model`` on ``rows`` × ``n`` random tokens."""
    ids = torch.randint(0, vocab, (rows, n), device=device)
    sync_device(device)
    t = time.perf_counter()
    logits = model(input_ids=ids).logits
    torch.log_softmax(logits.float(), -1)[..., 0].sum().backward()
    sync_device(device)
    return time.perf_counter() - t


def _time_decode(cfg: SaorlConfig, model, rows: int, prompt: int, vocab: int) -> tuple[float, float]:
    """(one decode step of ``rows`` rows, the prefill per token) of the engine the run decodes with:
    :meth:`LocalEngine.from_config` of the run's local engine section (packed weights where the run
    packs them), timed by the engine's own phase counters on its second batch (the first sets up
    its kernels)."""
    section = cfg.rollout.local_engine.model_copy(update={"slots": rows})
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(rows)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = LocalEngine.from_config(section, model, run_tokenizer(cfg.model), device=cfg.model.device,
                                     stop_on_eos=False)
    try:
        engine.generate(prompts, params)
        before = engine.stats()
        engine.generate(prompts, params)
        after = engine.stats()
    finally:
        engine.close()
    d = {k: after[k] - before[k] for k in ("decode_step_s", "decode_steps", "prefill_s", "prefill_tokens")}
    return d["decode_step_s"] / max(1, d["decode_steps"]), d["prefill_s"] / max(1, d["prefill_tokens"])


def _generation(cal: Calibration, shape: Shape, n: int) -> float:
    if n <= 0:
        return 0.0
    return max(n / cal.slots, 1.0) * shape.generated * cal.decode + n * shape.prompt * cal.prefill_per_token


def evaluations(cfg: SaorlConfig, steps: int | None = None) -> int:
    """Evaluations a run to ``steps`` (``trainer.steps`` when None) makes: step 0
    (``run.eval_at_start``), every ``run.eval_every`` steps and the last step."""
    if cfg.run.eval_tasks == 0:
        return 0
    steps, every = cfg.trainer.steps if steps is None else steps, cfg.run.eval_every
    return int(cfg.run.eval_at_start) + steps // every + (1 if steps % every else 0)


def phase_estimates(cfg: SaorlConfig, cal: Calibration, shape: Shape, *, sft_cached: bool = False,
                    critic_cached: bool = False, cores: int | None = None) -> list[dict]:
    """One row per phase: ``phase``, ``size`` (words), ``seconds`` (None: not estimated: a
    server's generation) and ``each`` (an RL step's or one evaluation's seconds), ``note``."""
    preset = cfg.algo.preset
    rows: list[dict] = []

    if cfg.sft.enabled:
        s = cfg.sft
        secs = s.steps * ((cal.sft_pass or 0.0) + cal.opt) + s.num_demos * (shape.demo_s or 0.0)
        rows.append(dict(phase="sft", size=f"{s.num_demos} demonstrations, {s.steps} steps of {s.batch_size}",
                         seconds=0.0 if sft_cached else secs, each=None, note="cached" if sft_cached else ""))
    if preset.use_critic and preset.value_pretrain and cfg.value_pretrain.enabled and not cfg.model.critic:
        vp = cfg.value_pretrain
        fits = 3 if vp.curve else 1
        secs = _generation(cal, shape, vp.rollouts) + fits * vp.steps * (cal.fit_pass * CRITIC_PASS + cal.opt)
        rows.append(dict(phase="value pretraining",
                         size=f"{vp.rollouts} rollouts, {fits} fit{'s' if fits > 1 else ''} of {vp.steps} "
                              f"steps of {vp.batch_size}",
                         seconds=0.0 if critic_cached else secs, each=None,
                         note="cached" if critic_cached else ""))
    b, k = cfg.trainer.batch_size, preset.critic_updates if preset.use_critic else 0
    critic = k * CRITIC_PASS + 2 * CRITIC_FORWARD if preset.use_critic else 0.0
    train = cal.rl_pass * (1 + critic) + (1 + k) * cal.opt
    gen = _generation(cal, shape, b) if cal.rl_generation else None
    shared = _threads_share_cores(cfg, cores)
    step = train if gen is None else (train + gen if shared else max(train, gen))
    n_test = min(cfg.run.eval_tasks, cfg.env.num_test_tasks)
    each = _generation(cal, shape, n_test)
    steps, cap = cfg.trainer.steps, cfg.trainer.max_wall_s
    if cap is not None:  # the budget holds the evaluations too: the steps that fit in it
        per_step = step + (each / cfg.run.eval_every if n_test else 0.0)
        steps = max(0, min(steps, int(cap // per_step)))
    n_eval = evaluations(cfg, steps)
    if n_eval:
        rows.append(dict(phase="evaluation", size=f"{n_test} episodes, {n_eval} times",
                         seconds=n_eval * each, each=each, note=""))
    total = cfg.trainer.steps * step
    note = (f"trainer.max_wall_s stops it at {_human(cap)}, about step {steps}"
            if cap is not None and steps < cfg.trainer.steps else "")
    if gen is None:
        note = "training only: generation on servers" + (f"; {note}" if note else "")
    rows.append(dict(phase=preset.name, size=f"{cfg.trainer.steps} steps of {b} trajectories"
                     + (f", K={k}" if k else ""), seconds=min(total, cap) if cap is not None else total,
                     each=step, note=note))
    return rows


def _threads_share_cores(cfg: SaorlConfig, cores: int | None) -> bool:
    cores = cores or os.cpu_count() or 1
    threads = cfg.trainer_threads() + cfg.worker_processes * cfg.runtime.worker_threads
    return cfg.runtime.backend == "inprocess" or threads > cores


def _human(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def format_estimate(rows: list[dict], cal: Calibration, shape: Shape) -> str:
    """The table ``saorl train`` prints at start-up."""
    dec = f", a decode step of {cal.slots} rows {cal.decode * 1e3:.0f} ms"
    lines = [f"start-up estimate, from a {cal.took_s:.1f} s calibration here (forward+backward "
             f"{cal.per_token * 1e3:.2f} ms a token, AdamW step {cal.opt:.2f} s{dec}), the rollouts' replies "
             f"as long as the budget allows ({shape.generated} tokens after a {shape.prompt:.0f}-token "
             "prompt), so those phases usually take less:"]
    width = max(len(r["size"]) for r in rows)
    for r in rows:
        secs = "?" if r["seconds"] is None else _human(r["seconds"])
        each = ""
        if r["each"] is not None and r["phase"] == "evaluation":
            each = f" ({_human(r['each'])} each)"
        elif r["each"] is not None:
            each = f" ({_human(r['each'])} a step)"
        note = f"; {r['note']}" if r["note"] else ""
        lines.append(f"  {r['phase']:<18} {r['size']:<{width}}  ~{secs}{each}{note}")
    return "\n".join(lines)


def estimate_phases(cfg: SaorlConfig, policy_spec: str, run_dir: Path, *, sft_cached: bool,
                    critic_cached: bool, log: Callable[[str], None] = print,
                    shelf: PolicyShelf | None = None) -> list[dict] | None:
    """Calibrate, print the table and write ``RUN/estimate.json``; None (and a line saying why)
    when the calibration itself fails: an estimate never stops a run."""
    try:
        shape = trajectory_shape(cfg)
        cal = calibrate(cfg, policy_spec, shape, shelf)
        rows = phase_estimates(cfg, cal, shape, sft_cached=sft_cached, critic_cached=critic_cached)
    except Exception as e:  # an estimate never stops a run: its own stages report real problems
        log(f"start-up estimate skipped: {type(e).__name__}: {e}")
        return None
    log(format_estimate(rows, cal, shape))
    (run_dir / "estimate.json").write_text(json.dumps(
        {"calibration": asdict(cal), "shape": asdict(shape), "phases": rows}, indent=2) + "\n")
    return rows


def cached_stages(cfg: SaorlConfig) -> tuple[str, bool, bool]:
    """``(the policy RL will start from, its SFT warm start cached, its pretrained critic cached)``."""
    from saorl.stages.sft import cached_sft_dir
    from saorl.stages.value_pretrain import cached_critic_dir

    spec, sft_cached = cfg.model.policy, False
    if cfg.sft.enabled:
        out = cached_sft_dir(cfg)
        spec, sft_cached = str(out), (out / "config.json").is_file()
    critic = cached_critic_dir(cfg, spec) / "critic.json"
    return (spec if sft_cached else cfg.model.policy), sft_cached, critic.is_file()


def start_up_estimate(cfg: SaorlConfig, run_dir: Path, log: Callable[[str], None] = print, *,
                      resume: bool = False, shelf: PolicyShelf | None = None) -> list[dict] | None:
    """:func:`estimate_phases` for the run of ``cfg`` in ``run_dir`` as ``saorl train`` starts it
    (``run.estimate``, null: for a policy that is not a tiny kind; never for a sharded trainer,
    whose model may not fit one process, nor for a resume: the fresh run's stays in
    ``estimate.json``)."""
    from saorl.models.source import is_tiny

    wanted = cfg.run.estimate
    if wanted is None:
        wanted = not is_tiny(cfg.model.policy)
    if not wanted or resume or cfg.trainer.shard == "fsdp2":
        return None
    spec, sft_cached, critic_cached = cached_stages(cfg)
    return estimate_phases(cfg, spec, run_dir, sft_cached=sft_cached, critic_cached=critic_cached, log=log,
                           shelf=shelf)
