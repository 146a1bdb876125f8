"""A rollout worker: one OS process, one inference engine, many concurrent episodes.

The worker receives :class:`RolloutRequest` messages (a rollout id, a task, the training
progress and the oldest weight version it may sample with), runs one episode per request with
the agent loop, and sends each finished trajectory back the moment it is done. It samples with
the newest weights it has: a background task polls the :class:`~saorl.runtime.weights.FileWeightSync`
directory and hands new weights to the engine, which applies them between decode steps, so a
trajectory can span versions and records the version of every token.
"""

from __future__ import annotations

import asyncio
import os
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from saorl.engines.base import SamplingParams
from saorl.envs.base import Progress, Task


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build its engine and env (picklable)."""

    policy: str
    tokenizer: str | None
    env_type: str
    env_options: dict[str, Any]
    weights_dir: str
    sampling: SamplingParams
    engine_slots: int = 16
    max_total_tokens: int = 384
    threads: int = 1
    seed: int = 0
    engine_kind: str = "local"
    http_url: str | None = None
    device: str = "cpu"
    dtype: str = "float32"


@dataclass(frozen=True)
class RolloutRequest:
    rid: int
    task: Task
    progress: Progress = field(default_factory=Progress)
    min_version: int = 0


def _build_engine(spec: WorkerSpec, tokenizer):
    if spec.engine_kind == "http":
        from saorl.engines.http_client import HttpEngine

        return HttpEngine(spec.http_url)
    from saorl.engines.local import LocalEngine
    from saorl.models.loading import load_policy

    model = load_policy(spec.policy, seed=spec.seed, device=spec.device, dtype=spec.dtype)
    return LocalEngine(model, tokenizer, max_batch_size=spec.engine_slots, version=0, device=spec.device)


class _WeightFollower:
    """Loads newly published weights into the engine; waits for a minimum version on demand."""

    def __init__(self, engine, weights_dir: str) -> None:
        from saorl.runtime.weights import FileWeightSync

        self.engine, self.sync = engine, FileWeightSync(weights_dir)
        self.version = -1

    def refresh(self) -> None:
        latest = self.sync.latest_version()
        if latest is None or latest <= self.version:
            return
        got = self.sync.load()
        if got is not None:
            self.version = got[0]
            self.engine.update_weights(got[1], got[0])

    async def wait_for(self, version: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.version < version:
            self.refresh()
            if self.version >= version:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights version {version} not published within {timeout_s}s")
            await asyncio.sleep(0.02)


async def _run(worker_id: int, spec: WorkerSpec, requests, results) -> None:
    from saorl.agent.loop import run_episode
    from saorl.envs.registry import make_env_factory
    from saorl.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec.tokenizer)
    engine = _build_engine(spec, tokenizer)
    follower = _WeightFollower(engine, spec.weights_dir)
    follower.refresh()
    env_factory = make_env_factory(spec.env_type, spec.env_options)
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task] = set()

    async def one(req: RolloutRequest) -> None:
        try:
            await follower.wait_for(req.min_version)
            t_start = time.time()
            traj = await run_episode(engine, env_factory(), req.task, tokenizer, sampling=spec.sampling,
                                     max_total_tokens=spec.max_total_tokens, progress=req.progress,
                                     sample_index=req.rid)
            traj.metadata["worker"] = worker_id
            traj.metadata["t_start"], traj.metadata["t_end"] = t_start, time.time()
            traj.metadata["rid"] = req.rid
            results.put(("traj", worker_id, req.rid, traj.to_dict()))
        except Exception as e:  # reported to the trainer, which re-queues or fails loudly
            results.put(("error", worker_id, req.rid, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    stopping = False
    last_stats = 0.0
    while not stopping or running:
        follower.refresh()
        try:
            msg = await loop.run_in_executor(None, requests.get, True, 0.05)
        except queue.Empty:
            msg = "idle"
        if msg is None:
            stopping = True
        elif isinstance(msg, RolloutRequest):
            t = asyncio.create_task(one(msg))
            running.add(t)
            t.add_done_callback(running.discard)
        if time.monotonic() - last_stats > 1.0 and hasattr(engine, "stats"):
            results.put(("stats", worker_id, -1, engine.stats()))
            last_stats = time.monotonic()
        await asyncio.sleep(0)
    if hasattr(engine, "stats"):
        results.put(("stats", worker_id, -1, engine.stats()))
    engine.close()


def worker_main(worker_id: int, spec: WorkerSpec, requests, results) -> None:
    """Process entry point (spawned)."""
    import signal

    import torch

    # Ctrl-C in a terminal reaches the whole process group: the trainer handles it (checkpoint,
    # then an orderly shutdown of the workers), so a worker must not die of it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed + 1000 * worker_id)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        asyncio.run(_run(worker_id, spec, requests, results))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        results.put(("fatal", worker_id, -1, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
