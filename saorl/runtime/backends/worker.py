"""A rollout worker: one inference engine, many concurrent episodes, one rollout per request.

:func:`play_rollout` is what every backend runs per :class:`RolloutRequest`: wait until the
engine has weights at least as new as the request's ``min_version``, play one episode with the
agent loop (its sampling seed derived from the rollout id), and fill in the trajectory's episode
record (rollout id, worker, wall-clock start and end).

:func:`worker_main` is the local backend's worker process: it builds its engine and env from a
:class:`WorkerSpec` (:func:`build_worker`, which the Ray backend's actors call too), receives
requests on a queue, runs each as an asyncio task and sends each finished trajectory back the
moment it is done. It samples with the newest weights it has: a :class:`WeightFollower` polls the
run's :class:`~saorl.runtime.weights.files.WeightSource` and hands the engine each newly published
version (a path, or tensors from Ray's object store), which it applies between decode steps, so a
trajectory can span versions and records the version of every token.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from saorl.config.engines import EngineConfig, LocalEngineConfig
from saorl.data.trajectory import Trajectory
from saorl.engines.base import InferenceEngine, SamplingParams
from saorl.engines.clients.routes import RouteLayout
from saorl.envs import pyast
from saorl.envs.toolbox import ToolOptions
from saorl.models.codec import TokenizerSpec
from saorl.runtime.backends.messages import (
    EngineStats,
    RolloutFailed,
    RolloutFinished,
    RolloutRequest,
    WorkerCrashed,
)
from saorl.runtime.weights.base import WeightSource
from saorl.runtime.weights.files import FileSource

STATS_EVERY_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build its engine and env (picklable)."""

    policy: str
    tokenizer: TokenizerSpec
    """The run's tokenizer (its local directory and prompt format), as the trainer resolved it."""
    env_type: str
    env_options: dict[str, Any]
    weights_dir: str
    sampling: SamplingParams
    engine: EngineConfig = field(default_factory=LocalEngineConfig)
    """``rollout.engine``: the engine's kind and its knobs (a local engine's ``dtype`` resolved:
    ``model.dtype`` where it had none)."""
    max_total_tokens: int = 384
    threads: int = 1
    seed: int = 0
    device: str = "cpu"
    record_routes: bool = False
    """The engine returns each token's MoE routes (routing replay): the local engine records them,
    a server client asks for them and checks them against ``route_layout``."""
    route_layout: RouteLayout | None = None
    """The policy's MoE layers and experts, which a server's routes must fit."""
    env_call_timeout_s: float | None = None
    """``env.call_timeout_s``: the deadline of each call into user code (None: none)."""
    env_observation_format: str | None = None
    """``env.observation_format`` (None: the env's own)."""
    env_observation_role: str | None = None
    """``env.observation_role`` (None: the env's own)."""
    env_tools: ToolOptions | None = None
    """``env.tools`` and ``env.tool_*`` (None, or no specs: the env's own tools, if any)."""


class WeightFollower:
    """Loads newly published weights into the engine; waits for a minimum version on demand.

    :meth:`refresh` may be called from several threads (an event loop and its executor): one
    update at a time."""

    def __init__(self, engine: InferenceEngine, sync: WeightSource) -> None:
        self.engine, self.sync = engine, sync
        self.version = -1
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            latest = self.sync.latest()
            if latest is None or latest[0] <= self.version:
                return
            version, source = latest
            try:
                self.engine.update_weights(source, version)
            except FileNotFoundError:
                return  # pruned between the pointer read and the load: a newer one is published
            self.version = version

    async def wait_for(self, version: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.version < version:
            # off the event loop: reading the pointer may be a remote call (Ray's registry)
            await asyncio.get_running_loop().run_in_executor(None, self.refresh)
            if self.version >= version:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights version {version} not published within {timeout_s}s")
            await asyncio.sleep(0.02)


async def play_rollout(engine: InferenceEngine, env_factory: Callable, tokenizer: Any, req: RolloutRequest, *,
                       sampling: SamplingParams, max_total_tokens: int, worker: int,
                       follower: WeightFollower | None = None,
                       env_executor: Executor | None = None) -> Trajectory:
    """One rollout: ``req.task`` played once, seeded by ``req.rid``, its episode record filled in. An
    ``openai_agent`` env's episode is its agent program's (:mod:`saorl.agent.openai_episode`), any
    other env's the agent loop's."""
    from saorl.agent.loop import run_episode
    from saorl.envs.openai_agent import OpenAIAgentEnv

    if follower is not None:
        await follower.wait_for(req.min_version)
    t_start = time.time()
    env = env_factory()
    if isinstance(env, OpenAIAgentEnv):
        from saorl.agent.openai_episode import play_agent_episode

        traj = await play_agent_episode(engine, env, req.task, tokenizer, sampling=sampling,
                                        max_total_tokens=max_total_tokens, sample_index=req.rid)
    else:
        traj = await run_episode(engine, env, req.task, tokenizer, sampling=sampling,
                                 max_total_tokens=max_total_tokens, progress=req.progress,
                                 env_executor=env_executor, sample_index=req.rid)
    ep = traj.episode
    ep.rid, ep.group, ep.worker, ep.t_start, ep.t_end = req.rid, req.group, worker, t_start, time.time()
    return traj


def build_engine(spec: WorkerSpec, tokenizer) -> InferenceEngine:
    """The worker's engine: the local torch engine, or a client of the servers in ``spec.engine``."""
    e = spec.engine
    if not isinstance(e, LocalEngineConfig):
        from saorl.engines.kinds import ClientOptions, server_kind

        options = ClientOptions(return_routes=spec.record_routes, route_layout=spec.route_layout)
        return server_kind(e.kind).client(e, options)
    from saorl.engines.local import LocalEngine
    from saorl.models.loading import load_policy

    model = load_policy(spec.policy, seed=spec.seed, device=spec.device, dtype=e.dtype or "float32")
    if e.perturbed:
        from saorl.models.routing import perturb_routing

        perturb_routing(model, top_k=e.moe_top_k, noise_std=e.router_noise, seed=spec.seed)
    return LocalEngine.from_config(e, model, tokenizer, device=spec.device, record_routes=spec.record_routes,
                                   release_weights=e.pack_in_place)


@dataclass
class WorkerStack:
    """What one rollout worker runs: its tokenizer, engine, weight follower and env factory."""

    tokenizer: Any
    engine: InferenceEngine
    follower: WeightFollower
    env_factory: Callable


def build_worker(spec: WorkerSpec, weights: WeightSource | None = None) -> WorkerStack:
    """A worker's engine and env from ``spec``, following ``weights`` (default: the files in
    ``spec.weights_dir``); the newest published weights are loaded before it returns."""
    from saorl.envs.registry import make_env_factory

    tokenizer = spec.tokenizer.load()
    engine = build_engine(spec, tokenizer)
    follower = WeightFollower(engine, weights if weights is not None else FileSource(spec.weights_dir))
    follower.refresh()
    factory = make_env_factory(spec.env_type, spec.env_options, call_timeout_s=spec.env_call_timeout_s,
                               observation_format=spec.env_observation_format,
                               observation_role=spec.env_observation_role, tool_options=spec.env_tools)
    return WorkerStack(tokenizer, engine, follower, factory)


def rollout_failed(worker: int, rid: int, error: Exception) -> RolloutFailed:
    """What a worker reports for a rollout whose episode raised ``error`` (traceback included)."""
    from saorl.agent.loop import EpisodeTimeout
    from saorl.envs.hosted import child_traceback

    text = f"{type(error).__name__}: {error}\n{pyast.format_exc()}"
    child = child_traceback(error)
    if child is not None:  # user code that raised in the child process that ran it
        text += f"In the process that ran the call:\n{child}"
    return RolloutFailed(worker, rid, text, timed_out=isinstance(error, EpisodeTimeout))


def prepare_worker_process(worker_id: int, spec: WorkerSpec) -> None:
    """Threads and seeds of a process that hosts one rollout worker."""
    import torch

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed + 1000 * worker_id)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _follow_engine(engine: InferenceEngine, pulse, stop: threading.Event) -> threading.Thread:
    """A thread that copies the engine's work counters into ``pulse`` five times a second, so the
    watchdog sees tokens decoded even while the event loop is held (a weight load waiting for a
    long forward)."""
    def run() -> None:
        while not stop.wait(0.2):
            pulse.work(engine.stats())

    t = threading.Thread(target=run, name="saorl-pulse", daemon=True)
    t.start()
    return t


async def _serve(worker_id: int, spec: WorkerSpec, requests, results, pulse=None) -> None:
    stack = build_worker(spec)
    engine, follower = stack.engine, stack.follower
    stop_pulse = threading.Event()
    if pulse is not None:
        _follow_engine(engine, pulse, stop_pulse)
    results.put(EngineStats(worker_id, engine.stats()))  # ready: the engine is built
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task] = set()

    async def one(req: RolloutRequest) -> None:
        try:
            traj = await play_rollout(engine, stack.env_factory, stack.tokenizer, req, sampling=spec.sampling,
                                      max_total_tokens=spec.max_total_tokens, worker=worker_id,
                                      follower=follower)
            results.put(RolloutFinished(worker_id, traj))
        except Exception as e:  # reported to the trainer, which re-queues or fails loudly
            results.put(rollout_failed(worker_id, req.rid, e))
        if pulse is not None:
            pulse.call()

    stopping = False
    last_stats = time.monotonic()
    # a thread of its own for the request queue: env calls (a reward that hangs until its deadline)
    # can fill the default executor, and the heartbeat below must not wait for them
    inbox = ThreadPoolExecutor(1, thread_name_prefix="saorl-inbox")
    while not stopping or running:
        if pulse is not None:
            pulse.call()
        follower.refresh()
        try:
            msg = await loop.run_in_executor(inbox, requests.get, True, 0.05)
        except queue.Empty:
            msg = "idle"
        if msg is None:
            stopping = True
        elif isinstance(msg, RolloutRequest):
            t = asyncio.create_task(one(msg))
            running.add(t)
            t.add_done_callback(running.discard)
        if time.monotonic() - last_stats > STATS_EVERY_S:
            results.put(EngineStats(worker_id, engine.stats()))
            last_stats = time.monotonic()
        await asyncio.sleep(0)
    results.put(EngineStats(worker_id, engine.stats()))
    stop_pulse.set()
    inbox.shutdown(wait=False)
    engine.close()
    stack.env_factory.close()


def worker_main(worker_id: int, spec: WorkerSpec, requests, results, pulse=None) -> None:
    """Process entry point (spawned); ``pulse``: the
    :class:`~saorl.runtime.backends.watchdog.WorkerPulse` its progress goes to."""
    import signal

    # Ctrl-C in a terminal, and a SIGTERM sent to the job's process group (systemd, SLURM,
    # `kill -- -PGID`), reach every process: the trainer handles them (checkpoint, then an orderly
    # shutdown of the workers), so a worker must not die of them first. It dies with the trainer.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prepare_worker_process(worker_id, spec)
    try:
        asyncio.run(_serve(worker_id, spec, requests, results, pulse))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        results.put(WorkerCrashed(worker_id, f"{type(e).__name__}: {e}\n{pyast.format_exc()}"))
        raise
