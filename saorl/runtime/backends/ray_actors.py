"""Rollout workers as Ray actors: the Ray backend (``runtime.backend: ray``).

The same :class:`~saorl.runtime.backends.base.Backend` contract as the local worker processes, with Ray
placing and restarting the workers; the run loop, feed, journal and checkpoints stay in this
process (the Ray driver), unchanged.

- **Cluster** (:class:`RayCluster`): ``ray.init(address=ray.address)`` (after a bounded TCP check
  of the address: :func:`~saorl.runtime.backends.ray_check.check_reachable`; the start-up checks have
  already found it answering and big enough, :mod:`saorl.runtime.backends.ray_check`), or a private local
  cluster (``ray.num_cpus`` logical CPUs, a short session directory under /tmp) that
  :meth:`RayBackend.shutdown` stops, so no Ray process outlives the run. It runs no dashboard:
  ``include_dashboard=False`` still starts Ray's head process ``dashboard.py`` (minimal, for usage
  statistics), which is stopped as soon as the cluster is up. If the trainer dies without stopping
  the cluster (``kill -9``), a :class:`~saorl.runtime.backends.lifeline.Reaper` kills its daemons and
  deletes its session directory; if the reaper dies with it (``kill -9`` of the whole process
  group), the next private cluster's start deletes the directory (it is marked with its owner:
  :func:`~saorl.runtime.backends.lifeline.mark_owner`,
  :func:`~saorl.runtime.backends.lifeline.remove_orphans`). A cluster someone else initialised in
  this process is used as it is and left running.
- **Placement**: one placement group, a bundle per worker (``ray.worker_cpus`` / ``worker_gpus``)
  placed by ``ray.placement_strategy``, plus a trainer bundle (``ray.trainer_cpus`` /
  ``trainer_gpus``) pinned to this node so that no worker takes the trainer's share.
- **Workers** (:class:`RolloutActor`): an async actor per bundle running the local backend's own
  worker code — :func:`~saorl.runtime.backends.worker.build_worker` (engine, env, weight follower) and
  :func:`~saorl.runtime.backends.worker.play_rollout` per request — with a background task that follows
  the published weights (files in the run directory, or the object store:
  :mod:`saorl.runtime.weights.ray_store`).
- **Transport**: :meth:`RayBackend.submit` calls ``actor.rollout`` (an ``ObjectRef`` resolving to
  :class:`~saorl.runtime.backends.messages.RolloutFinished` or ``RolloutFailed``); every worker also has
  one ``stats`` call in flight, answered about once a second with ``EngineStats`` (it is also how
  the death of an idle worker is noticed). :meth:`RayBackend.poll` is ``ray.wait`` over all of
  them and ``ray.get`` of those ready, folded into a ``PollResult`` like any backend's messages.
- **Deaths**: Ray restarts a dead actor in its bundle; the calls in flight to it fail with
  ``RayActorError``. The first such failure of an incarnation counts a restart
  (:attr:`RayBackend.restarts`), reports every rollout assigned to the worker as lost (the feed
  re-queues them) and starts a new incarnation: an answer from a call made to the old one is
  discarded from then on — its rollout was re-queued, and keeping both would train it twice.
  Until the restarted actor answers a ``stats`` call (calls to a restarting actor fail at once;
  the call is repeated every :data:`RETRY_S`), it gets no rollouts and holds no slots. Past
  ``ray.max_restarts`` deaths, or when Ray gives the actor up,
  :class:`~saorl.runtime.backends.base.WorkerFailure`;
  a placement group not granted within ``ray.ready_timeout_s`` (its resources exist, the start-up
  checks saw to that, but other jobs hold them) is a :class:`~saorl.errors.RunFailure`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from saorl.config import RayConfig
from saorl.errors import RunFailure
from saorl.runtime.backends.base import WorkerFailure, collect
from saorl.runtime.backends.lifeline import Reaper, descendants, mark_owner, remove_orphans
from saorl.runtime.backends.messages import (
    EngineStats,
    PollResult,
    RolloutFailed,
    RolloutFinished,
    RolloutRequest,
)
from saorl.runtime.backends.ray_check import bundle_shapes, check_reachable
from saorl.runtime.backends.worker import (
    STATS_EVERY_S,
    WorkerSpec,
    build_worker,
    play_rollout,
    prepare_worker_process,
    rollout_failed,
)
from saorl.runtime.weights.base import WeightSource

TEMP_PREFIX = "saorl-ray-"
"""Session directories saorl makes for private clusters: ``/tmp/saorl-ray-*``."""
REFRESH_EVERY_S = 0.05
RETRY_S = 0.5
"""Seconds between ``stats`` calls to a restarting actor."""


class RayCluster:
    """The Ray cluster of a run: joined at ``ray.address`` or started privately (module docstring)."""

    def __init__(self, cfg: RayConfig) -> None:
        self.cfg, self.owned, self.temp_dir, self._made_temp = cfg, False, None, False
        self._reaper: Reaper | None = None
        if ray.is_initialized():
            return  # initialised by the caller (e.g. a notebook): theirs to stop
        self.owned = True
        if cfg.address is not None:
            check_reachable(cfg.address)  # Ray's own connect retries for minutes, deaf to SIGTERM
            ray.init(address=cfg.address)
            return
        remove_orphans(f"/tmp/{TEMP_PREFIX}*")
        self.temp_dir = cfg.temp_dir or tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
        self._made_temp = cfg.temp_dir is None
        if self._made_temp:
            mark_owner(self.temp_dir)
        ray.init(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, include_dashboard=False,
                 _temp_dir=self.temp_dir)
        _stop_dashboard()
        if sys.platform.startswith("linux"):  # the cluster's daemons die with this process
            daemons = descendants(os.getpid())
            self._reaper = Reaper()
            self._reaper.watch(daemons)
            if self._made_temp:
                self._reaper.remove_dir(self.temp_dir)

    def logs_hint(self) -> str:
        if self.temp_dir is not None:
            return f"the workers' logs are in {self.temp_dir}/session_latest/logs"
        return "the workers' logs are under /tmp/ray/session_latest/logs on their nodes"

    def stop(self) -> None:
        if self.owned and ray.is_initialized():
            ray.shutdown()
        if self._made_temp and self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None


def _stop_dashboard() -> None:
    """Stop the private cluster's ``dashboard.py`` (module docstring); nothing of the run uses it."""
    node = getattr(ray._private.worker, "_global_node", None)
    try:
        node.kill_dashboard(check_alive=False)
    except Exception:  # another Ray version: it keeps running, and the reaper still covers it
        pass


class RolloutActor:
    """One rollout worker in a Ray actor (used through ``ray.remote``; see the module docstring)."""

    def __init__(self, worker_id: int, spec: WorkerSpec, weights: WeightSource | None) -> None:
        # the weight follower's ray.get runs in executor threads, never on the event loop; Ray
        # warns of any ray.get in an async actor
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        prepare_worker_process(worker_id, spec)
        self.id, self.spec = worker_id, spec
        self.stack = build_worker(spec, weights)
        self._follow: asyncio.Task | None = None
        self._playing = 0  # rollouts this incarnation is playing now

    async def _follow_weights(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await loop.run_in_executor(None, self.stack.follower.refresh)
            await asyncio.sleep(REFRESH_EVERY_S)

    def _stats(self) -> EngineStats:
        if self._follow is None:  # the actor's event loop runs by now: start following weights
            self._follow = asyncio.get_running_loop().create_task(self._follow_weights())
        return EngineStats(self.id, self.stack.engine.stats())

    async def stats(self, wait_s: float = 0.0) -> EngineStats:
        await asyncio.sleep(wait_s)
        return self._stats()

    async def rollout(self, req: RolloutRequest) -> RolloutFinished | RolloutFailed:
        self._stats()
        s = self.stack
        self._playing += 1
        try:
            traj = await play_rollout(s.engine, s.env_factory, s.tokenizer, req, sampling=self.spec.sampling,
                                      max_total_tokens=self.spec.max_total_tokens, worker=self.id,
                                      follower=s.follower)
            return RolloutFinished(self.id, traj)
        except Exception as e:  # reported to the trainer, which re-queues or fails loudly
            return rollout_failed(self.id, req.rid, e)
        finally:
            self._playing -= 1

    async def playing(self) -> int:
        """How many rollouts this actor is playing now (for tests and operators)."""
        return self._playing

    def pid(self) -> int:
        return os.getpid()


class RayBackend:
    """``num_workers`` :class:`RolloutActor` s, ``concurrency`` rollouts each (module docstring)."""

    def __init__(self, spec: WorkerSpec, cfg: RayConfig, num_workers: int, concurrency: int,
                 cluster: RayCluster, weights: WeightSource | None = None) -> None:
        self.spec, self.cfg, self.cluster, self.weights = spec, cfg, cluster, weights
        self.num_workers, self.concurrency, self.max_restarts = num_workers, concurrency, cfg.max_restarts
        self._actors: list = []
        self._pg = None
        self._refs: dict[Any, tuple[int, int, int | None]] = {}  # ref -> (worker, incarnation, rid)
        self._incarnation = [0] * num_workers
        self._up = [False] * num_workers  # answered a call since it (re)started
        self._retry_at: dict[int, float] = {}  # restarting worker -> when to call it again
        self._assigned: list[set[int]] = [set() for _ in range(num_workers)]
        self._stats: dict[int, dict] = {}
        self.restarts = 0

    # ---------------------------------------------------------------- workers
    def _bundles(self) -> tuple[list[dict[str, float]], int]:
        trainer, worker = bundle_shapes(self.cfg)
        if trainer is None:
            return [worker] * self.num_workers, 0
        trainer[f"node:{ray.util.get_node_ip_address()}"] = 0.001  # the trainer runs here
        return [trainer] + [worker] * self.num_workers, 1

    def start(self) -> None:
        bundles, first = self._bundles()
        self._pg = placement_group(bundles, strategy=self.cfg.placement_strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.cfg.ready_timeout_s)
        if not ready:
            raise RunFailure(
                f"the Ray cluster did not grant the rollout workers' placement group within "
                f"ray.ready_timeout_s={self.cfg.ready_timeout_s:g}s: it asks for {bundles} "
                f"({self.cfg.placement_strategy}); the cluster has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free now, so other jobs hold what the run needs. Wait for "
                "them or lower rollout.num_workers, ray.worker_cpus / worker_gpus or ray.trainer_cpus, "
                "then resume the run (saorl train --resume RUN_DIR)")
        actor_cls = ray.remote(RolloutActor)
        for i in range(self.num_workers):
            actor = actor_cls.options(
                num_cpus=self.cfg.worker_cpus, num_gpus=self.cfg.worker_gpus,
                max_restarts=self.max_restarts, max_task_retries=0,
                max_concurrency=self.concurrency + 8, name=f"saorl-rollout-{i}",  # in the run's namespace
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=first + i),
            ).remote(i, self.spec, self.weights)
            self._actors.append(actor)
            self._stats_call(i, wait_s=0.0)  # answered once the engine is built: ready

    def _stats_call(self, i: int, wait_s: float = STATS_EVERY_S) -> None:
        self._refs[self._actors[i].stats.remote(wait_s)] = (i, self._incarnation[i], None)

    def ready(self) -> bool:
        return all(self._up)

    def pids(self) -> list[int]:
        """The worker actors' process ids (for tests and operators)."""
        return ray.get([a.pid.remote() for a in self._actors])

    def _died(self, i: int, error: BaseException, out: PollResult) -> None:
        """Worker ``i``'s current incarnation is dead: count it, re-queue its rollouts."""
        self.restarts += 1
        self._incarnation[i] += 1
        cause = " ".join(str(error).split())[:300]
        if self.restarts > self.max_restarts:
            raise WorkerFailure(
                f"rollout worker {i} (a Ray actor) died: {cause}. That is {self.restarts} worker deaths "
                f"in this run, more than ray.max_restarts={self.max_restarts}, so the run stops instead "
                f"of restarting it again: a worker that keeps dying is a bug or a resource problem "
                f"(memory, a lost node) to look at; {self.cluster.logs_hint()}. If the deaths are "
                "expected (preemptible nodes), raise ray.max_restarts.")
        self._up[i] = False
        lost = sorted(self._assigned[i])
        self._assigned[i].clear()
        out.lost.extend(lost)
        out.errors.append(f"rollout worker {i} (Ray actor) died ({cause}); Ray restarts it, "
                          f"{len(lost)} rollouts re-queued")
        for ref, (w, _, _) in list(self._refs.items()):
            if w == i:  # calls made to the dead incarnation: nothing they return is kept
                del self._refs[ref]
                try:
                    ray.cancel(ref)
                except Exception:
                    pass
        self._retry_at[i] = time.monotonic()

    def _call_restarting(self) -> None:
        now = time.monotonic()
        for i, at in list(self._retry_at.items()):
            if now >= at:
                del self._retry_at[i]
                self._stats_call(i, wait_s=0.0)

    def _restart_failed(self, i: int, error: BaseException) -> None:
        """A call to restarting worker ``i`` failed: still restarting, or given up by Ray."""
        if isinstance(error, ray.exceptions.ActorDiedError):
            cause = " ".join(str(error).split())
            cause = cause if len(cause) <= 600 else "..." + cause[-600:]  # the error is at the end
            raise WorkerFailure(
                f"rollout worker {i} (a Ray actor) could not be {'re' if self.restarts else ''}started: "
                f"{cause}. Ray gave it up; {self.cluster.logs_hint()}.")
        self._retry_at[i] = time.monotonic() + RETRY_S

    # --------------------------------------------------------------- requests
    def free_slots(self) -> int:
        return sum(self.concurrency - len(a) for a, up in zip(self._assigned, self._up) if up)

    def submit(self, req: RolloutRequest) -> None:
        up = [j for j in range(self.num_workers) if self._up[j]]
        i = min(up, key=lambda j: len(self._assigned[j]), default=None)
        if i is None or len(self._assigned[i]) >= self.concurrency:
            raise RuntimeError("no free rollout slot; check free_slots() before submit()")
        self._assigned[i].add(req.rid)
        self._refs[self._actors[i].rollout.remote(req)] = (i, self._incarnation[i], req.rid)

    def poll(self, timeout_s: float) -> PollResult:
        out = PollResult()
        self._call_restarting()
        if not self._refs:
            time.sleep(timeout_s)
            return out
        ready, _ = ray.wait(list(self._refs), num_returns=1, timeout=timeout_s)
        if ready:  # then everything else that is there too
            ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        for ref in ready:
            if ref in self._refs:  # not dropped by a death found earlier in this loop
                self._receive(ref, out)
        return out

    def _receive(self, ref, out: PollResult) -> None:
        i, incarnation, rid = self._refs.pop(ref)
        try:
            msg = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:
            # OutOfMemoryError: Ray's memory monitor killed the worker's process, a death like any
            # other (restarted, its rollouts re-queued; the cause, naming memory, in the message)
            if incarnation == self._incarnation[i]:
                if self._up[i]:
                    self._died(i, e, out)
                else:
                    self._restart_failed(i, e)
            return
        except ray.exceptions.RayError as e:  # the call itself failed (e.g. the request did not pickle)
            if rid is None:
                raise
            msg = RolloutFailed(i, rid, f"{type(e).__name__}: {e}")
        if incarnation != self._incarnation[i]:
            return
        if isinstance(msg, EngineStats):
            self._up[i] = True
            self._stats_call(i)
        collect(msg, out, self._assigned, self._stats)

    def engine_stats(self) -> dict[int, dict]:
        return dict(self._stats)

    def shutdown(self) -> None:
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._actors, self._refs, self._pg = [], {}, None
        self.cluster.stop()
