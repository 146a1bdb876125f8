"""The in-process backend: episodes on one engine, in an event loop thread of this process.

Same :class:`~saorl.runtime.backends.base.Backend` protocol as the worker processes, without any: a
request becomes an asyncio task on a private event loop (one background thread), which plays it
with :func:`~saorl.runtime.backends.worker.play_rollout` on the given engine and puts the result on a
queue that :meth:`InProcessBackend.poll` drains. An episode that raises is reported as a lost
rollout, as a crashed worker's would be. It runs what needs no process of its own: evaluation,
value pretraining's rollouts, ``runtime.backend=inprocess`` runs, and the schedule's unit tests
(with a fake engine, in milliseconds).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from saorl.engines.base import InferenceEngine, SamplingParams
from saorl.errors import RunFailure
from saorl.runtime.backends.base import collect, drain
from saorl.runtime.backends.messages import (
    EngineStats,
    PollResult,
    RolloutFinished,
    RolloutRequest,
)
from saorl.runtime.backends.worker import WeightFollower, play_rollout, rollout_failed
from saorl.runtime.weights.base import WeightSource


class InProcessBackend:
    """``concurrency`` rollouts at a time on ``engine`` (see the module docstring).

    With ``weights`` the engine follows the published weights as a worker process does
    (requests wait for their ``min_version``); without, it samples with the weights it has.
    With ``owns_engine`` :meth:`shutdown` closes the engine too.
    """

    restarts = 0
    worker = 0

    def __init__(self, engine: InferenceEngine, env_factory: Callable, tokenizer: Any, *,
                 sampling: SamplingParams, max_total_tokens: int, concurrency: int,
                 weights: WeightSource | None = None, owns_engine: bool = False) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.engine, self.env_factory, self.tokenizer = engine, env_factory, tokenizer
        self.sampling, self.max_total_tokens, self.concurrency = sampling, max_total_tokens, concurrency
        self.follower = WeightFollower(engine, weights) if weights is not None else None
        self.owns_engine = owns_engine
        self._results: queue.Queue = queue.Queue()
        self._assigned: list[set[int]] = [set()]
        self._stats: dict[int, dict] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(concurrency, thread_name_prefix="saorl-env")
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        if self._thread is not None:
            return
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="saorl-inprocess-rollouts", daemon=True)
        self._thread.start()
        started.wait()
        if self.follower is not None:
            self.follower.refresh()

    def ready(self) -> bool:
        return self._thread is not None

    def free_slots(self) -> int:
        return self.concurrency - len(self._assigned[0])

    def submit(self, req: RolloutRequest) -> None:
        if self._loop is None:
            raise RuntimeError("InProcessBackend.submit before start()")
        if len(self._assigned[0]) >= self.concurrency:
            raise RuntimeError("no free rollout slot; check free_slots() before submit()")
        self._assigned[0].add(req.rid)
        self._loop.call_soon_threadsafe(self._launch, req)

    def _launch(self, req: RolloutRequest) -> None:
        task = asyncio.ensure_future(self._one(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, req: RolloutRequest) -> None:
        try:
            if self.follower is not None:
                self.follower.refresh()
            traj = await play_rollout(self.engine, self.env_factory, self.tokenizer, req,
                                      sampling=self.sampling, max_total_tokens=self.max_total_tokens,
                                      worker=self.worker, follower=self.follower,
                                      env_executor=self._executor)
            self._results.put(RolloutFinished(self.worker, traj))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._results.put(rollout_failed(self.worker, req.rid, e))

    def poll(self, timeout_s: float) -> PollResult:
        out = PollResult()
        drain(self._results, timeout_s, out, self._assigned, self._stats)
        stats = getattr(self.engine, "stats", None)
        if stats is not None:
            collect(EngineStats(self.worker, stats()), out, self._assigned, self._stats)
        return out

    def engine_stats(self) -> dict[int, dict]:
        return dict(self._stats)

    def shutdown(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            async def cancel_all() -> None:
                for t in list(self._tasks):
                    t.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()
        self._loop = self._thread = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.owns_engine:
            self.engine.close()


class Stopped(Exception):
    """:func:`run_requests` gave up because its ``should_stop()`` became true."""


class RolloutTimeout(RunFailure):
    """A rollout's call into user code ran past ``env.call_timeout_s`` where nothing retries it."""


class EpisodeFailed(RunFailure):
    """A rollout that failed where nothing retries it (an evaluation, value pretraining): the env
    or a reward function raised. A run fails with it as it does when a training rollout fails too
    often (exit status 3): a failing env or reward function is not a bug in saorl."""


def run_requests(backend: InProcessBackend, requests: list[RolloutRequest],
                 on_done: Callable[[int, int], None] | None = None, *,
                 should_stop: Callable[[], bool] | None = None,
                 timeouts: dict[int, str] | None = None) -> dict[int, Any]:
    """Play every request on ``backend`` (started and shut down here); trajectories by rollout id.

    The first failed rollout raises :class:`EpisodeFailed` with its error (nothing is retried: a
    fixed set of episodes, as evaluation wants), except one whose call into user code ran past its
    deadline: with ``timeouts`` given it is recorded there (rollout id → the timeout's message) and
    counts as done — evaluation counts it as a failed episode — else it raises
    :class:`RolloutTimeout`. ``on_done(done, total)`` is called as rollouts finish;
    ``should_stop()`` true raises :class:`Stopped` (the rollouts in flight are cancelled).
    """
    todo, out = list(reversed(requests)), {}
    timed_out: dict[int, str] = {} if timeouts is None else timeouts
    backend.start()
    try:
        while todo or len(out) + len(timed_out) < len(requests):
            if should_stop is not None and should_stop():
                raise Stopped(f"stopped with {len(out)} of {len(requests)} rollouts done")
            while todo and backend.free_slots() > 0:
                backend.submit(todo.pop())
            res = backend.poll(0.05)
            for rid in res.lost:
                if rid not in res.timeouts:
                    mine = [e for e in res.errors if e.startswith(f"rollout {rid} ")]
                    raise EpisodeFailed((mine or res.errors or [f"rollout {rid} failed"])[0])
                if timeouts is None:
                    raise RolloutTimeout(res.timeouts[rid])
                timed_out[rid] = res.timeouts[rid]
            for traj in res.finished:
                out[traj.episode.rid] = traj
            if (res.finished or res.lost) and on_done is not None:
                on_done(len(out) + len(timed_out), len(requests))
    finally:
        backend.shutdown()
    return out
