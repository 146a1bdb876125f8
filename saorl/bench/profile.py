"""Where the time goes: the rollout engine and one trainer step, each measured alone.

Both profiles time the *real* runtime code from outside, by wrapping the functions it calls
(module attributes and instance methods, for the duration of the measurement only); no runtime
file is edited. A wrapped call's time is *inclusive* (a critic forward inside a backward is not
possible here, so the pieces do not nest except where said).

- :func:`rollout_profile` — one :class:`~saorl.engines.local.LocalEngine` with the run's slots,
  driven by the agent loop over the run's env at steady state (every slot refilled at once), no
  trainer. Pieces: prefill (model forward on prompts), decode forward, sampling
  (``sample_rows``), KV bookkeeping (``kv.merge`` / ``select_rows`` / ``trim`` /
  ``zero_padding``), the rest of a decode step (per-row stop checks, delivery), and the engine
  thread's time outside steps (waiting for the event loop to submit the next turn). Also gives
  the generation throughput of this workload (action tokens / s) — the pipeline's rollout limit.
- :func:`decode_curve` — seconds per decode step (forward + sampling + bookkeeping) vs the
  number of sequences decoding, for the simulator.
- :func:`learner_profile` — :meth:`~saorl.runtime.learner.Learner.step` on a batch of real
  trajectories of the workload: collate, critic forwards with grad (K updates) and without
  (targets, values), critic / policy backward + optimizer step, policy forward, the rest
  (advantages, losses, metrics); then weight publication (state dict → safetensors file) and
  the worker side of it (load + apply in the engine), and the trajectory transport (worker →
  queue → trainer: dict + pickle round trip; journal append with fsync).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from saorl.config import SaorlConfig
from saorl.data.trajectory import Trajectory


@dataclass
class Timings:
    """Accumulated seconds and call counts per label."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, label: str, dt: float) -> None:
        self.seconds[label] += dt
        self.calls[label] += 1

    def wrap(self, fn: Callable, label: str | Callable[..., str]) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(label(*args, **kwargs) if callable(label) else label, time.perf_counter() - t0)

        return timed


@contextmanager
def patched(*targets: tuple[object, str, Callable]) -> Iterator[None]:
    """Temporarily set ``obj.name = value`` for each ``(obj, name, value)``."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in targets]
    try:
        for obj, name, value in targets:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def profile_rows(t: Timings, total_s: float, order: list[str], steps: int = 1) -> list[dict]:
    """Rows ``{piece, ms_per_step, share, calls}`` in ``order``; ``share`` is of ``total_s``."""
    return [{"piece": k, "ms_per_step": 1000 * t.seconds.get(k, 0.0) / steps,
             "share": t.seconds.get(k, 0.0) / total_s if total_s > 0 else 0.0,
             "calls": t.calls.get(k, 0) / steps} for k in order]


# --------------------------------------------------------------------------- engine
def _engine_parts(cfg: SaorlConfig):
    from saorl.engines.local import LocalEngine
    from saorl.envs.registry import make_env_factory
    from saorl.models.loading import load_policy
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.model.tokenizer)
    model = load_policy(cfg.model.policy, seed=cfg.seed)
    engine = LocalEngine(model, tok, max_batch_size=cfg.rollout.engine_slots)
    return engine, tok, make_env_factory(cfg.env.type, cfg.env.options)


def _instrument_engine(engine, t: Timings):
    from saorl.engines import kv, local

    def fwd_label(*args, **kw):
        return "prefill forward" if kw["input_ids"].shape[1] > 1 else "decode forward"

    def step_label(*_a, **_k):
        return "decode step (total)"

    return patched(
        (engine.model, "forward", t.wrap(engine.model.forward, fwd_label)),
        (engine, "_decode_step", t.wrap(engine._decode_step, step_label)),
        (engine, "_prefill", t.wrap(engine._prefill, "prefill (total)")),
        (local, "sample_rows", t.wrap(local.sample_rows, "sampling")),
        *((kv, n, t.wrap(getattr(kv, n), "kv merge/select/trim")) for n in ("merge", "select_rows", "trim",
                                                                            "zero_padding")),
    )


async def _stream_for(engine, tok, env_factory, tasks, cfg: SaorlConfig, warmup_s: float,
                      duration_s: float, on_start: Callable[[], None]) -> list[Trajectory]:
    from saorl.agent.loop import stream_episodes
    from saorl.runtime.setup import sampling_params

    out: list[Trajectory] = []
    gen = stream_episodes(engine, env_factory, itertools.cycle(tasks), tok,
                          concurrency=cfg.rollout.concurrent_episodes, sampling=sampling_params(cfg),
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


def rollout_profile(cfg: SaorlConfig, duration_s: float, warmup_s: float = 2.0) -> dict:
    """Generation alone at steady state; see the module docstring. Uses the current torch threads."""
    from saorl.runtime.setup import build_tasks

    engine, tok, env_factory = _engine_parts(cfg)
    tasks = build_tasks(cfg, env_factory)[0]
    t = Timings()
    mark: dict = {}

    def start() -> None:
        t.seconds.clear()
        t.calls.clear()
        mark["t0"], mark["stats0"] = time.perf_counter(), engine.stats()

    try:
        with _instrument_engine(engine, t):
            trajs = asyncio.run(_stream_for(engine, tok, env_factory, tasks, cfg, warmup_s, duration_s,
                                            start))
        wall = time.perf_counter() - mark["t0"]
        s1 = engine.stats()
    finally:
        engine.close()
    s0 = mark["stats0"]
    steps = s1["decode_steps"] - s0["decode_steps"]
    tokens = s1["tokens_generated"] - s0["tokens_generated"]
    busy = s1["busy_slot_steps"] - s0["busy_slot_steps"]
    sec = t.seconds
    sec["decode rest (stop checks, delivery)"] = max(0.0, sec["decode step (total)"] - sec["decode forward"]
                                                    - sec["sampling"])
    sec["outside steps (waiting for turns, loop)"] = max(0.0, wall - sec["decode step (total)"]
                                                         - sec["prefill (total)"])
    order = ["prefill forward", "prefill (total)", "decode forward", "sampling", "kv merge/select/trim",
             "decode rest (stop checks, delivery)", "decode step (total)",
             "outside steps (waiting for turns, loop)"]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "decode_steps": steps,
            "mean_batch": busy / steps if steps else 0.0, "slots": cfg.rollout.engine_slots,
            "pure_decode_tokens_per_s": busy / max(sec["decode step (total)"], 1e-9),
            "rows": profile_rows(t, wall, order), "trajectories": trajs}


def decode_curve(cfg: SaorlConfig, batches: tuple[int, ...], steps: int = 24) -> list[tuple[int, float]]:
    """``(b, seconds per decode step)`` with exactly ``b`` sequences decoding (median over steps)."""
    from saorl.engines import SamplingParams
    from saorl.engines.local import LocalEngine
    from saorl.models.loading import load_policy
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.model.tokenizer)
    engine = LocalEngine(load_policy(cfg.model.policy, seed=cfg.seed), tok,
                         max_batch_size=max(batches), stop_on_eos=False)
    by_b: dict[int, list[float]] = defaultdict(list)
    inner = engine._decode_step

    def timed() -> None:
        b = len(engine._active)
        t0 = time.perf_counter()
        inner()
        by_b[b].append(time.perf_counter() - t0)

    try:
        with patched((engine, "_decode_step", timed)):
            for i, b in enumerate((max(batches), *batches)):
                prompts = [[2 + (7 * r + j) % 1000 for j in range(12)] for r in range(b)]
                engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=steps + 1, seed=0))
                if i == 0:  # the first round warms the kernels up (first use of a shape is slow)
                    by_b.clear()
    finally:
        engine.close()
    return [(b, sorted(by_b[b])[len(by_b[b]) // 2]) for b in batches if by_b.get(b)]


# -------------------------------------------------------------------------- learner
def build_learner(cfg: SaorlConfig):
    """A :class:`~saorl.runtime.learner.Learner` as :class:`~saorl.runtime.trainer.Run` builds it."""
    from saorl.models.loading import load_policy
    from saorl.models.tokenizer import load_tokenizer
    from saorl.runtime.learner import Learner, OptimConfig
    from saorl.runtime.setup import build_critic

    preset = cfg.algo.resolve()
    policy = load_policy(cfg.model.policy, dtype=cfg.model.dtype, device=cfg.model.device, seed=cfg.seed)
    tr = cfg.trainer
    return Learner(policy, build_critic(cfg, policy, preset, cfg.model.critic), preset,
                   OptimConfig(tr.policy_lr, tr.critic_lr, tr.weight_decay, tr.grad_clip, tr.warmup_steps),
                   pad_id=load_tokenizer(cfg.model.tokenizer).pad_token_id,
                   temperature=cfg.rollout.temperature, device=cfg.model.device)


def _instrument_learner(learner, t: Timings):
    from saorl.runtime import learner as lmod

    def step_label(params, optimizer, *_a):
        which = "critic" if optimizer is learner.critic_opt else "policy"
        return f"{which} backward + optimizer"

    targets = [(lmod, "collate", t.wrap(lmod.collate, "collate")),
               (lmod, "token_logprobs", t.wrap(lmod.token_logprobs, "policy forward")),
               (lmod, "_finite_step", t.wrap(lmod._finite_step, step_label))]
    if learner.critic is not None:
        def critic_label(*_a, **_k):
            return "critic forward (grad)" if torch.is_grad_enabled() else "critic forward (no grad)"

        targets.append((learner.critic, "forward", t.wrap(learner.critic.forward, critic_label)))
    return patched(*targets)


def group_ids(n: int, group_size: int) -> list[int]:
    return [i // group_size for i in range(n)]


def time_steps(learner, batches: list[list[Trajectory]], group_size: int) -> tuple[Timings, float]:
    """Instrumented ``learner.step`` over ``batches`` (after one untimed warm-up step)."""
    learner.step(batches[0], group_ids(len(batches[0]), group_size))
    t = Timings()
    with _instrument_learner(learner, t):
        t0 = time.perf_counter()
        for b in batches:
            learner.step(b, group_ids(len(b), group_size))
        total = time.perf_counter() - t0
    return t, total


def learner_profile(cfg: SaorlConfig, trajs: list[Trajectory], repeats: int = 3) -> dict:
    """One trainer step of ``cfg``'s algorithm on ``trainer.batch_size`` of ``trajs`` (see module doc)."""
    from saorl.runtime.journal import Journal
    from saorl.runtime.weights import FileWeightSync

    bs, g = cfg.trainer.batch_size, cfg.algo.resolve().group_size
    if len(trajs) < bs:
        raise ValueError(f"learner_profile needs at least batch_size={bs} trajectories, got {len(trajs)}")
    learner = build_learner(cfg)
    batches = [trajs[(i * bs) % (len(trajs) - bs + 1):][:bs] for i in range(repeats)]
    t, total = time_steps(learner, batches, g)
    sec = t.seconds
    sec["advantages, losses, metrics (rest)"] = max(0.0, total - sum(sec.values()))
    sec["learner.step (total)"] = total
    with tempfile.TemporaryDirectory() as d:
        sync = FileWeightSync(f"{d}/w")
        for _ in range(repeats):
            t0 = time.perf_counter()
            sync.publish(learner.policy_state(), learner.version)
            t.add("weight publication (state dict -> file)", time.perf_counter() - t0)
            t0 = time.perf_counter()
            _, state = sync.load()
            learner.policy.load_state_dict(state)
            t.add("weight load + apply (worker side)", time.perf_counter() - t0)
        journal = Journal(f"{d}/j")
        for rid, traj in enumerate(batches[0]):
            t0 = time.perf_counter()
            Trajectory.from_dict(pickle.loads(pickle.dumps(traj.to_dict())))
            t.add("transport (dict + pickle round trip)", time.perf_counter() - t0)
            t0 = time.perf_counter()
            journal.append(rid, traj)
            t.add("journal append (fsync)", time.perf_counter() - t0)
        journal.close()
    for k in ("transport (dict + pickle round trip)", "journal append (fsync)"):  # per batch of bs, × repeats
        sec[k] *= repeats
        t.calls[k] = bs * repeats
    tokens = sum(tr.num_action_tokens for b in batches for tr in b) / repeats
    order = ["collate", "critic forward (grad)", "critic backward + optimizer", "critic forward (no grad)",
             "policy forward", "policy backward + optimizer", "advantages, losses, metrics (rest)",
             "learner.step (total)", "weight publication (state dict -> file)",
             "weight load + apply (worker side)", "transport (dict + pickle round trip)",
             "journal append (fsync)"]
    step_s = total / repeats
    return {"step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "publish_s": sec["weight publication (state dict -> file)"] / repeats,
            "rows": [r for r in profile_rows(t, total, order, repeats) if r["calls"] or r["ms_per_step"]]}


def train_cost_fit(cfg: SaorlConfig, trajs: list[Trajectory], sizes: tuple[int, int], repeats: int = 2
                   ) -> tuple[float, float]:
    """``(a, b)`` with step seconds ≈ a + b · action tokens, from steps on two batch sizes."""
    g = cfg.algo.resolve().group_size
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
        bs, g = cfg.trainer.batch_size, cfg.algo.resolve().group_size
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
