"""What a Ray run needs from its cluster, checked in seconds, before the first stage.

:func:`check_cluster` runs in the start-up checks (:func:`saorl.stages.preflight.check_ray`), before
the SFT warm start and value pretraining, and raises :class:`~saorl.errors.StartupError` (exit 2,
one paragraph, no run directory made):

- **the address answers** (``ray.address``): a plain TCP connection to its ``host:port`` within
  :data:`CONNECT_TIMEOUT_S`; then a child process (``python -m saorl.runtime.backends.ray_check ADDRESS``)
  joins the cluster and reports its alive nodes' total resources and this machine's IP, within
  :data:`PROBE_TIMEOUT_S`. It is a child because Ray's own connection retries (about 40 s for an
  address nothing answers, then more) run in C++ code that does not return to Python, so
  neither a timeout nor SIGTERM reaches the trainer meanwhile; the child is killed instead, and
  dies with the trainer (``PR_SET_PDEATHSIG``). ``auto`` (no host and port to try) goes straight
  to the child; a ``ray://host:port`` client address is tried at its host and port too;
- **the resources exist**: the run's placement group (:func:`bundle_shapes`: a trainer bundle pinned
  to this machine's node, one bundle per rollout worker) fits the cluster's *total* resources
  under ``ray.placement_strategy`` (:func:`placement_problem`). A private cluster is this machine:
  ``ray.num_cpus`` logical CPUs (by default the cores Ray counts) and the GPUs torch can use
  (capped by ``ray.num_gpus``). Resources that exist but are held by other jobs are not checked:
  the placement group then waits ``ray.ready_timeout_s`` and the run stops with a
  :class:`~saorl.errors.RunFailure`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from saorl.config import RayConfig
from saorl.errors import StartupError

CONNECT_TIMEOUT_S = 3.0
"""Seconds a TCP connection to ``ray.address`` may take."""
PROBE_TIMEOUT_S = 20.0
"""Seconds the child that joins the cluster may take (importing Ray, connecting, listing nodes)."""
EPS = 1e-4  # Ray's resource unit


@dataclass
class ClusterView:
    """Alive nodes' total resources (``{"CPU": 8.0, "GPU": 1.0, ...}``) and which is this machine's."""

    nodes: list[dict[str, float]]
    names: list[str]
    here: int | None
    where: str
    """What it is, for messages: "the Ray cluster at ADDRESS" or "the private Ray cluster ..."."""
    how: str = ""
    """How the counts were found (a private cluster), or whether this machine is a node."""


def bundle_shapes(cfg: RayConfig) -> tuple[dict[str, float] | None, dict[str, float]]:
    """The trainer's bundle (None when it reserves nothing) and one rollout worker's bundle."""
    worker = {"CPU": cfg.worker_cpus} | ({"GPU": cfg.worker_gpus} if cfg.worker_gpus else {})
    trainer = {k: v for k, v in (("CPU", cfg.trainer_cpus), ("GPU", cfg.trainer_gpus)) if v}
    return trainer or None, worker


# ------------------------------------------------------------------------------- reachability
def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port``; None for ``auto`` or no port."""
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """:class:`StartupError` unless something at ``address`` takes a TCP connection in ``timeout_s``."""
    target = host_port(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as e:
        why = f"no answer within {timeout_s:.0f} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise StartupError(
            f"ray.address={address}: nothing answers there ({why}), so no Ray cluster can be joined. "
            "Start the cluster first (`ray start --head` on its head node) and give its address "
            "(host:6379, or auto on one of its nodes), or remove ray.address to let saorl start a "
            "private cluster on this machine") from None


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> ClusterView:
    """Join the cluster at ``address`` in a child process and list its alive nodes (module docstring)."""
    cmd = [sys.executable, "-m", "saorl.runtime.backends.ray_check", address, str(os.getpid())]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise StartupError(
            f"ray.address={address}: something takes connections there, but no Ray cluster answered "
            f"within {timeout_s:.0f} s. Check that it is the address of the cluster's head (its GCS, "
            "port 6379 by default, or ray://host:10001 for Ray Client) and that this machine's Ray "
            "version matches the cluster's, or remove ray.address to use a private cluster") from None
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        last = next((x for x in reversed(r.stderr.splitlines()) if x.strip()), f"exit status {r.returncode}")
        why = " ".join(last.split())[:300]
        raise StartupError(f"ray.address={address}: joining the Ray cluster failed ({why}). Check the "
                           "address and that the cluster is up (`ray status` on one of its nodes), or "
                           "remove ray.address to use a private cluster")
    seen = json.loads(lines[-1])
    ips = [n["ip"] for n in seen["nodes"]]
    here = ips.index(seen["here"]) if seen["here"] in ips else None
    how = f"this machine is node {ips[here]}" if here is not None else "this machine is not a node of it"
    resources = [n["resources"] for n in seen["nodes"]]
    return ClusterView(resources, ips, here, f"the Ray cluster at {address}", how)


def _probe_main(address: str, parent: int) -> None:
    from saorl.runtime.backends.lifeline import die_with_parent

    die_with_parent(parent, kernel_signal=True)
    import logging

    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    nodes = [{"ip": n["NodeManagerAddress"], "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]]
    print(json.dumps({"here": ray.util.get_node_ip_address(), "nodes": nodes}), flush=True)
    ray.shutdown()


# ---------------------------------------------------------------------------------- resources
def cuda_devices() -> int:
    """CUDA devices torch can use here (what a worker's engine on ``cuda`` would get)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def private_cluster(cfg: RayConfig) -> ClusterView:
    """This machine as its private cluster will see it: ``ray.num_cpus`` (or the cores Ray counts)
    and the GPUs torch can use (at most ``ray.num_gpus``)."""
    cpus, how = cfg.num_cpus, f"ray.num_cpus={cfg.num_cpus:g}" if cfg.num_cpus else ""
    if cpus is None:
        try:
            from ray._private.utils import get_num_cpus  # what ray.init counts (cgroup quotas included)

            cpus = float(get_num_cpus())
        except Exception:
            cpus = float(len(os.sched_getaffinity(0)))
        how = "ray.num_cpus unset: the cores Ray counts"
    usable = cuda_devices()
    gpus = usable if cfg.num_gpus is None else min(cfg.num_gpus, usable)
    how += f"; torch sees {usable} CUDA device(s)"
    if cfg.num_gpus is not None:
        how += f", ray.num_gpus={cfg.num_gpus}"
    return ClusterView([{"CPU": float(cpus), "GPU": float(gpus)}], ["this machine"], 0,
                       "the private Ray cluster on this machine", how)


def _fits(bundle: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in bundle.items())


def _take(bundle: dict[str, float], free: dict[str, float]) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def placement_problem(trainer: dict[str, float] | None, worker: dict[str, float], n: int, strategy: str,
                      view: ClusterView) -> str | None:
    """Why the bundles cannot be placed on ``view``'s nodes under ``strategy``, or None.

    Identical worker bundles: the most a node can hold is set by each node alone, so filling the
    nodes one by one (the trainer's first, on this machine's node) is exact for PACK and SPREAD
    (soft strategies: any node), STRICT_PACK (all on this machine's node when a trainer bundle is
    pinned there, else on one node) and STRICT_SPREAD (one bundle per node)."""
    free = [dict(r) for r in view.nodes]
    if trainer is not None:
        if view.here is None:
            return ("the trainer's bundle (ray.trainer_cpus / trainer_gpus) is pinned to this machine's "
                    "node, and this machine is not a node of the cluster")
        if not _fits(trainer, free[view.here]):
            return f"the trainer's bundle {trainer} does not fit this machine's node {view.nodes[view.here]}"
        _take(trainer, free[view.here])
    if strategy == "STRICT_PACK":
        candidates = [view.here] if trainer is not None else range(len(free))
        if any(_fits({k: v * n for k, v in worker.items()}, free[i]) for i in candidates):
            return None
        node = "this machine's node" if trainer is not None else "any one node"
        return f"STRICT_PACK puts all {n} worker bundles on one node, and {node} has no room for them"
    placed = 0
    for i, node in enumerate(free):
        if strategy == "STRICT_SPREAD" and trainer is not None and i == view.here:
            continue  # one bundle per node: this one holds the trainer's
        while placed < n and _fits(worker, node):
            _take(worker, node)
            placed += 1
            if strategy == "STRICT_SPREAD":
                break
    if placed >= n:
        return None
    return f"room for {placed} of the {n} worker bundles"


def _show(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU"))


def check_cluster(cfg: RayConfig, num_workers: int) -> None:
    """The address answers and the placement group fits (module docstring); :class:`StartupError`."""
    trainer, worker = bundle_shapes(cfg)
    if cfg.address is None:
        if worker.get("GPU") and num_workers and cuda_devices() == 0:
            raise StartupError(
                f"ray.worker_gpus={cfg.worker_gpus:g}: each rollout worker's engine would run on a GPU of "
                "the private Ray cluster on this machine, but torch sees no CUDA device here. Set "
                "ray.worker_gpus=0 to sample on CPU, or join a cluster with GPUs (ray.address)")
        view = private_cluster(cfg)
        more = ("raise ray.num_cpus (logical CPUs: Ray does not hold them to the cores; the workers "
                "then share the cores)")
    else:
        check_reachable(cfg.address)
        view = probe(cfg.address)
        more = "add nodes"
    problem = placement_problem(trainer, worker, num_workers, cfg.placement_strategy, view)
    if problem is None:
        return
    nodes = "; ".join(f"{name}: {_show(r)}" for name, r in zip(view.names, view.nodes)) or "no alive node"
    asks = (f"{num_workers} worker bundle(s) of {{{_show(worker)}}} (rollout.num_workers, "
            "ray.worker_cpus / worker_gpus)")
    if trainer is not None:
        asks += (f" and a trainer bundle of {{{_show(trainer)}}} on this machine (ray.trainer_cpus / "
                 "trainer_gpus)")
    raise StartupError(
        f"{view.where} cannot place the rollout workers: the run asks for {asks}, placed "
        f"{cfg.placement_strategy} (ray.placement_strategy), and it has {nodes} ({view.how}): {problem}. "
        f"Lower rollout.num_workers, ray.worker_cpus / worker_gpus or ray.trainer_cpus / trainer_gpus, "
        f"or {more}; otherwise the placement group would wait ray.ready_timeout_s={cfg.ready_timeout_s:g} s "
        "for resources that do not exist")


if __name__ == "__main__":
    _probe_main(sys.argv[1], int(sys.argv[2]))
