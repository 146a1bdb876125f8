"""Where the time goes: the rollout engine and one trainer step, each measured alone.

Both profiles read the timings the runtime reports itself: the engine's per-phase seconds in
``LocalEngine.stats()`` and the learner's spans in ``Learner.timings``; nothing is patched, so a
rename inside the runtime cannot silently break them. The pieces do not nest except where said.

- :func:`rollout_profile` — one :class:`~saorl.engines.local.LocalEngine` with the run's slots,
  driven by the agent loop over the run's env at steady state (every slot refilled at once), no
  trainer. Pieces: prefill (model forward on prompts), decode forward (of which the share of its
  rows that fed a session turn's new tokens, ``fed_s``), sampling (``sample_rows``), KV
  bookkeeping (``kv.merge`` / ``select_rows`` / ``trim`` / ``zero_padding`` / prefix copies), the
  rest of a decode step (per-row stop checks, delivery), and the engine thread's time outside
  steps (waiting for the event loop to submit the next turn). Also gives the generation
  throughput of this workload (action tokens / s) — the pipeline's rollout limit — and the
  **prefill share**: (prefill + fed rows' share of the decode forwards) / wall time.
- :func:`decode_curve` — seconds per decode step (forward + sampling + bookkeeping) vs the
  number of sequences decoding, for the simulator.
- :func:`learner_profile` — :meth:`~saorl.runtime.learner.single.Learner.step` on a batch of real
  trajectories of the workload: collate, critic forwards with grad (K updates) and without
  (targets, values), critic / policy backward + optimizer step, policy forward, the rest
  (advantages, losses, metrics); then weight publication (state dict → safetensors file) and
  the worker side of it (load + apply in the engine), and the trajectory transport (worker →
  queue → trainer: pickle round trip; journal append with fsync).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import tempfile
import time
from collections.abc import Callable

import torch

from saorl.config import SaorlConfig
from saorl.data.trajectory import Trajectory
from saorl.runtime.learner.timings import Timings


def profile_rows(t: Timings, total_s: float, order: list[str], steps: int = 1) -> list[dict]:
    """Rows ``{piece, ms_per_step, share, calls}`` in ``order``; ``share`` is of ``total_s``."""
    return [{"piece": k, "ms_per_step": 1000 * t.seconds.get(k, 0.0) / steps,
             "share": t.seconds.get(k, 0.0) / total_s if total_s > 0 else 0.0,
             "calls": t.calls.get(k, 0) / steps} for k in order]


# --------------------------------------------------------------------------- engine
def _engine_parts(cfg: SaorlConfig):
    from saorl.engines.local import LocalEngine
    from saorl.envs.registry import env_factory_for
    from saorl.models.codec import run_tokenizer
    from saorl.models.loading import load_policy

    tok = run_tokenizer(cfg.model)
    model = load_policy(cfg.model.policy, seed=cfg.seed)
    e = cfg.rollout.local_engine
    engine = LocalEngine.from_config(e, model, tok)
    return engine, tok, env_factory_for(cfg.env, deadline=False)


async def _stream_for(engine, tok, env_factory, tasks, cfg: SaorlConfig, warmup_s: float,
                      duration_s: float, on_start: Callable[[], None]) -> list[Trajectory]:
    from saorl.agent.loop import stream_episodes
    from saorl.engines.base import SamplingParams

    out: list[Trajectory] = []
    gen = stream_episodes(engine, env_factory, itertools.cycle(tasks), tok,
                          concurrency=cfg.rollout.concurrent_episodes,
                          sampling=SamplingParams.of_rollout(cfg.rollout),
                          max_total_tokens=cfg.rollout.max_total_tokens)
    t0, started = time.monotonic(), False
    try:
        async for traj in gen:
            out.append(traj)
            now = time.monotonic()
            if not started and now - t0 >= warmup_s:
                on_start()
                started, t0 = True, now
            elif started and now - t0 >= duration_s:
                break
    finally:
        await gen.aclose()
    return out


ENGINE_PIECES = {"prefill forward": "prefill_forward_s", "prefill (total)": "prefill_s",
                 "decode forward": "decode_forward_s",
                 "of which feeding turns' new tokens": "fed_s", "sampling": "sampling_s",
                 "kv merge/select/trim": "kv_s", "decode step (total)": "decode_step_s"}
"""Profile rows and the ``LocalEngine.stats()`` seconds they come from."""


def _delta(s0: dict, s1: dict, key: str) -> float:
    return s1.get(key, 0) - s0.get(key, 0)


def rollout_profile(cfg: SaorlConfig, duration_s: float, warmup_s: float = 2.0) -> dict:
    """Generation alone at steady state; see the module docstring. Uses the current torch threads."""
    from saorl.runtime.parts import build_tasks

    engine, tok, env_factory = _engine_parts(cfg)
    tasks = build_tasks(cfg, env_factory)[0]
    mark: dict = {}

    def start() -> None:
        mark["t0"], mark["stats0"] = time.perf_counter(), engine.stats()

    try:
        trajs = asyncio.run(_stream_for(engine, tok, env_factory, tasks, cfg, warmup_s, duration_s, start))
        wall = time.perf_counter() - mark["t0"]
        s1 = engine.stats()
    finally:
        engine.close()
    s0 = mark["stats0"]
    t = Timings()
    for label, key in ENGINE_PIECES.items():
        t.seconds[label] = _delta(s0, s1, key)
    t.calls["prefill (total)"] = int(_delta(s0, s1, "prefill_batches"))
    t.calls["decode step (total)"] = int(_delta(s0, s1, "decode_steps"))
    steps = int(_delta(s0, s1, "decode_steps"))
    tokens = _delta(s0, s1, "tokens_generated")
    busy = _delta(s0, s1, "busy_slot_steps")
    sec = t.seconds
    sec["decode rest (stop checks, delivery)"] = max(0.0, sec["decode step (total)"] - sec["decode forward"]
                                                    - sec["sampling"])
    sec["outside steps (waiting for turns, loop)"] = max(0.0, wall - sec["decode step (total)"]
                                                         - sec["prefill (total)"])
    order = ["prefill forward", "prefill (total)", "decode forward", "of which feeding turns' new tokens",
             "sampling", "kv merge/select/trim", "decode rest (stop checks, delivery)", "decode step (total)",
             "outside steps (waiting for turns, loop)"]
    prefill = sec["prefill (total)"] + sec["of which feeding turns' new tokens"]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "decode_steps": steps,
            "mean_batch": busy / steps if steps else 0.0, "slots": cfg.rollout.local_engine.slots,
            "pure_decode_tokens_per_s": busy / max(sec["decode step (total)"], 1e-9),
            "prefill_share": prefill / wall, "prefill_tokens": _delta(s0, s1, "prefill_tokens"),
            "prefix_tokens_reused": _delta(s0, s1, "prefix_tokens_reused"),
            "prefix_hits": int(_delta(s0, s1, "prefix_hits")), "requests": int(_delta(s0, s1, "prefills")),
            "rows": profile_rows(t, wall, order), "trajectories": trajs}


def decode_curve(cfg: SaorlConfig, batches: tuple[int, ...], steps: int = 24) -> list[tuple[int, float]]:
    """``(b, seconds per decode step)`` with exactly ``b`` sequences decoding (mean over steps).

    Each round runs ``b`` prompts for ``steps + 1`` tokens without stopping at EOS, so every
    decode step of the round has batch ``b``; the engine's ``decode_step_s`` over its
    ``decode_steps`` is the step time."""
    from saorl.engines import SamplingParams
    from saorl.engines.local import LocalEngine
    from saorl.models.codec import run_tokenizer
    from saorl.models.loading import load_policy

    tok = run_tokenizer(cfg.model)
    section = cfg.rollout.local_engine.model_copy(update={"slots": max(batches)})
    model = load_policy(cfg.model.policy, seed=cfg.seed)
    engine = LocalEngine.from_config(section, model, tok, stop_on_eos=False)
    out = []
    try:
        for i, b in enumerate((max(batches), *batches)):
            prompts = [[2 + (7 * r + j) % 1000 for j in range(12)] for r in range(b)]
            s0 = engine.stats()
            engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=steps + 1, seed=0))
            s1 = engine.stats()
            n = _delta(s0, s1, "decode_steps")
            if i > 0 and n:  # the first round warms the kernels up (first use of a shape is slow)
                out.append((b, _delta(s0, s1, "decode_step_s") / n))
    finally:
        engine.close()
    return out


# -------------------------------------------------------------------------- learner
def build_learner(cfg: SaorlConfig):
    """A :class:`~saorl.runtime.learner.single.Learner` as a run builds it, on ``model.policy`` as is."""
    from saorl.models.codec import run_tokenizer
    from saorl.models.loading import load_policy, train_dtype
    from saorl.runtime.parts import build_critic
    from saorl.runtime.parts import build_learner as runtime_learner

    policy = load_policy(cfg.model.policy, dtype=train_dtype(cfg.model.dtype), device=cfg.model.device,
                         seed=cfg.seed)
    preset = cfg.algo.preset
    critic = build_critic(cfg, policy, preset, cfg.model.critic)
    return runtime_learner(cfg, preset, policy, critic, run_tokenizer(cfg.model).pad_token_id)


def group_ids(n: int, group_size: int) -> list[int]:
    return [i // group_size for i in range(n)]


def time_steps(learner, batches: list[list[Trajectory]], group_size: int,
               metrics: list[dict] | None = None) -> tuple[Timings, float]:
    """``learner.step`` over ``batches`` (after one untimed warm-up step): its own span timings
    (``Learner.timings``) and the total seconds; each step's metrics go to ``metrics`` if given."""
    learner.step(batches[0], group_ids(len(batches[0]), group_size))
    learner.timings.reset()
    t0 = time.perf_counter()
    for b in batches:
        m = learner.step(b, group_ids(len(b), group_size))
        if metrics is not None:
            metrics.append(m)
    total = time.perf_counter() - t0
    t = Timings()
    t.seconds.update(learner.timings.seconds)
    t.calls.update(learner.timings.calls)
    return t, total


def learner_profile(cfg: SaorlConfig, trajs: list[Trajectory], repeats: int = 3) -> dict:
    """One trainer step of ``cfg``'s algorithm on ``trainer.batch_size`` of ``trajs`` (see module doc)."""
    from saorl.engines.packed import PackedLinears, packing_available
    from saorl.runtime.journal import Journal
    from saorl.runtime.weights.files import FilePublisher, FileSource

    pack = cfg.rollout.local_engine.pack_weights
    bs, g = cfg.trainer.batch_size, cfg.algo.preset.group_size
    if len(trajs) < bs:
        raise ValueError(f"learner_profile needs at least batch_size={bs} trajectories, got {len(trajs)}")
    learner = build_learner(cfg)
    batches = [trajs[(i * bs) % (len(trajs) - bs + 1):][:bs] for i in range(repeats)]
    step_metrics: list[dict] = []
    t, total = time_steps(learner, batches, g, step_metrics)
    sec = t.seconds
    sec["losses, metrics (rest)"] = max(0.0, total - sum(sec.values()))
    sec["learner.step (total)"] = total
    with tempfile.TemporaryDirectory() as d:
        sync, source = FilePublisher(f"{d}/w"), FileSource(f"{d}/w")
        for _ in range(repeats):
            t0 = time.perf_counter()
            sync.publish([learner.policy_state()], learner.version)
            t.add("weight publication (state dict -> file)", time.perf_counter() - t0)
            t0 = time.perf_counter()
            _, state = source.load()
            learner.policy.load_state_dict(state)
            if pack and packing_available(learner.policy):  # the worker's engine repacks its layers
                PackedLinears(learner.policy).remove()
            t.add("weight load + apply (worker side)", time.perf_counter() - t0)
        journal = Journal(f"{d}/j")
        for rid, traj in enumerate(batches[0]):
            traj.episode.rid = rid
            t0 = time.perf_counter()
            pickle.loads(pickle.dumps(traj))
            t.add("transport (pickle round trip)", time.perf_counter() - t0)
            t0 = time.perf_counter()
            journal.append(traj)
            t.add("journal append (fsync)", time.perf_counter() - t0)
        journal.close()
    for k in ("transport (pickle round trip)", "journal append (fsync)"):  # per batch of bs, × repeats
        sec[k] *= repeats
        t.calls[k] = bs * repeats
    tokens = sum(tr.num_action_tokens for b in batches for tr in b) / repeats
    order = ["collate", "critic forward (grad)", "critic backward + optimizer", "critic forward (no grad)",
             "advantages", "policy forward", "policy backward + optimizer", "losses, metrics (rest)",
             "learner.step (total)", "weight publication (state dict -> file)",
             "weight load + apply (worker side)", "transport (pickle round trip)",
             "journal append (fsync)"]
    step_s = total / repeats
    positions = sum(m["throughput/positions_per_action_token"] * sum(tr.num_action_tokens for tr in b)
                    for m, b in zip(step_metrics, batches)) / (tokens * repeats)
    return {"step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "positions_per_action_token": positions,
            "publish_s": sec["weight publication (state dict -> file)"] / repeats,
            "rows": [r for r in profile_rows(t, total, order, repeats) if r["calls"] or r["ms_per_step"]]}


def train_cost_fit(cfg: SaorlConfig, trajs: list[Trajectory], sizes: tuple[int, int], repeats: int = 2
                   ) -> tuple[float, float]:
    """``(a, b)`` with step seconds ≈ a + b · action tokens, from steps on two batch sizes."""
    g = cfg.algo.preset.group_size
    learner = build_learner(cfg)
    pts = []
    for n in sizes:
        n = max(g, n - n % g)
        batches = [trajs[i * n:(i + 1) * n] for i in range(repeats)]
        if any(len(b) < n for b in batches):
            raise ValueError(f"train_cost_fit needs {repeats * n} trajectories, got {len(trajs)}")
        _, total = time_steps(learner, batches, g)
        pts.append((sum(tr.num_action_tokens for b in batches for tr in b) / repeats, total / repeats))
    (x0, y0), (x1, y1) = pts
    b = max(0.0, (y1 - y0) / (x1 - x0)) if x1 != x0 else 0.0
    return max(0.0, y0 - b * x0), b


# ------------------------------------------------------------------------ contention
def _generation_child(cfg_data: dict, threads: int, seconds: float, out) -> None:
    from saorl.config import config_from_dict

    torch.set_num_threads(threads)
    cfg = config_from_dict(cfg_data)
    out.put(("ready", 0.0))
    out.put(("tokens_per_s", rollout_profile(cfg, seconds, warmup_s=2.0)["tokens_per_s"]))


def _from_child(q, child, timeout_s: float = 300.0):
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"generation process died (exit code {child.exitcode})") from None
    raise TimeoutError(f"generation process silent for {timeout_s:.0f}s")


def contention(cfg: SaorlConfig, trajs: list[Trajectory], seconds: float, worker_threads: int,
               trainer_threads: int) -> dict:
    """Both stages at once: generation in a child process (as a rollout worker) while this process
    runs SAO steps back to back. Returns each stage's throughput while sharing the machine."""
    import multiprocessing as mp

    from saorl.config import config_to_dict

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_generation_child, args=(config_to_dict(cfg), worker_threads, seconds, q),
                        daemon=True)
    child.start()
    try:
        torch.set_num_threads(trainer_threads)
        learner = build_learner(cfg)
        bs, g = cfg.trainer.batch_size, cfg.algo.preset.group_size
        learner.step(trajs[:bs], group_ids(bs, g))  # warm-up while the child loads
        _from_child(q, child)
        time.sleep(2.0)  # the child's own warm-up
        tokens, t0, i = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds * 0.9:
            batch = trajs[(i * bs) % (len(trajs) - bs + 1):][:bs]
            learner.step(batch, group_ids(bs, g))
            tokens += sum(t.num_action_tokens for t in batch)
            i += 1
        train_tps = tokens / (time.perf_counter() - t0)
        _, gen_tps = _from_child(q, child)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return {"generation_tokens_per_s": gen_tps, "train_tokens_per_s": train_tps, "train_steps": i}
