"""The start-up check of a Ray run's cluster: the address answers within seconds, the resources exist.

The placement arithmetic is checked on made-up clusters; the rest against the real thing: a
refused port, a private Ray cluster on loopback joined by the check's child process, and
``saorl train`` processes that must stop with one paragraph, exit status 2 and no run directory
before the SFT warm start (which would take minutes) begins.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from saorl.config import RayConfig
from saorl.errors import StartupError
from saorl.runtime.backends.ray_check import ClusterView, check_cluster, check_reachable, placement_problem

W, T = {"CPU": 1.0}, {"CPU": 1.0}


def _view(*nodes: dict, here: int | None = 0) -> ClusterView:
    return ClusterView(list(nodes), [f"n{i}" for i in range(len(nodes))], here, "test")


@pytest.mark.parametrize(("strategy", "nodes", "here", "n", "room"), [
    ("PACK", [{"CPU": 3}], 0, 2, None),
    ("PACK", [{"CPU": 2}], 0, 2, "room for 1 of the 2"),  # the trainer's bundle takes one CPU
    ("SPREAD", [{"CPU": 1}, {"CPU": 2}], 0, 2, None),  # spills over to the other node
    ("STRICT_PACK", [{"CPU": 1}, {"CPU": 8}], 0, 2, "this machine's node has no room"),
    ("STRICT_PACK", [{"CPU": 1}, {"CPU": 8}], 1, 2, None),
    ("STRICT_SPREAD", [{"CPU": 8}, {"CPU": 8}], 0, 2, "room for 1 of the 2"),  # not beside the trainer
    ("STRICT_SPREAD", [{"CPU": 8}, {"CPU": 8}, {"CPU": 1}], 0, 2, None),
    ("PACK", [{"CPU": 8}], None, 1, "not a node of the cluster"),  # a trainer off the cluster
])
def test_placement_of_the_bundles(strategy, nodes, here, n, room):
    problem = placement_problem(T, W, n, strategy, _view(*nodes, here=here))
    if room is None:
        assert problem is None, problem
    else:
        assert room in problem, problem


def test_gpus_and_no_trainer_bundle():
    gpu = {"CPU": 1.0, "GPU": 1.0}
    assert "room for 0" in placement_problem(None, gpu, 1, "PACK", _view({"CPU": 4, "GPU": 0}))
    assert placement_problem(None, {"CPU": 1.0, "GPU": 0.5}, 2, "PACK", _view({"CPU": 4, "GPU": 1})) is None
    assert placement_problem(None, W, 4, "STRICT_PACK", _view({"CPU": 2}, {"CPU": 4}, here=None)) is None


def test_an_address_nothing_answers_is_refused_in_seconds():
    t0 = time.monotonic()
    with pytest.raises(StartupError) as e:
        check_reachable("127.0.0.1:1")
    msg = str(e.value)
    assert time.monotonic() - t0 < 5
    assert "ray.address=127.0.0.1:1: nothing answers there" in msg and "remove ray.address" in msg
    assert "\n" not in msg
    check_reachable("auto")  # nothing to connect to here: the child that joins the cluster resolves it


def test_a_private_cluster_is_this_machine():
    with pytest.raises(StartupError) as e:
        check_cluster(RayConfig(worker_cpus=64, num_cpus=2), 1)
    msg = str(e.value)
    assert "private Ray cluster on this machine" in msg and "CPU 2" in msg and "ray.num_cpus=2" in msg
    assert "room for 0 of the 1 worker bundles" in msg and "ray.ready_timeout_s=600" in msg
    check_cluster(RayConfig(worker_cpus=1, num_cpus=3), 2)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(StartupError, match=r"ray.worker_gpus=1: .* torch sees no CUDA device here"):
            check_cluster(RayConfig(worker_gpus=1, num_gpus=1), 1)  # a logical GPU is no GPU


# ----------------------------------------------------------------------- a real cluster
@pytest.fixture(scope="module")
def cluster():
    """A private Ray cluster (3 logical CPUs) started in this process; its GCS address."""
    ray = pytest.importorskip("ray", reason="needs ray installed (pip install -e '.[ray]')")
    from saorl.runtime.backends.ray_actors import RayCluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    d = tempfile.mkdtemp(prefix="sr-", dir="/tmp")
    c = RayCluster(RayConfig(num_cpus=3, temp_dir=d))
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_the_cluster_at_an_address_is_joined_and_its_resources_counted(cluster):
    check_cluster(RayConfig(address=cluster, worker_cpus=1, trainer_cpus=1), 2)
    t0 = time.monotonic()
    with pytest.raises(StartupError) as e:
        check_cluster(RayConfig(address=cluster, worker_cpus=64), 2)
    msg = str(e.value)
    assert time.monotonic() - t0 < 20  # a child joins the cluster, lists its nodes and leaves
    assert f"the Ray cluster at {cluster} cannot place the rollout workers" in msg and "\n" not in msg
    assert "CPU 3" in msg and "this machine is node" in msg and "room for 0 of the 2" in msg
    with pytest.raises(StartupError, match="room for 0 of the 1"):
        check_cluster(RayConfig(address=cluster, worker_cpus=1, worker_gpus=1), 1)


# -------------------------------------------------------------------- saorl train processes
def _train(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    args = ["model.policy=tiny-moe", "value_pretrain.enabled=false", "env.num_test_tasks=8",
            "run.progress=false", f"run.out_dir={tmp_path / 'runs'}", *overrides,
            "--run-dir", str(tmp_path / "runs" / "run")]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "saorl.cli", "train", *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return r, time.monotonic() - t0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "expected"), [
    (["ray.address=127.0.0.1:1"], "ray.address=127.0.0.1:1: nothing answers there"),
    (["ray.worker_cpus=64"], "ray.worker_cpus / worker_gpus"),
    (["rollout.num_workers=3", "ray.num_cpus=2"], "room for 1 of the 3 worker bundles"),
])
def test_a_ray_run_that_cannot_start_stops_before_sft_with_exit_2(tmp_path, overrides, expected):
    """SFT is on (minutes on this model): the run stops before it, leaving nothing on disk."""
    r, took = _train(tmp_path, "runtime.backend=ray", *overrides)
    assert r.returncode == 2, r.stderr[-2000:]
    assert expected in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert took < 60, took
    assert not (tmp_path / "runs").exists()  # no run directory, no SFT cache


@pytest.mark.slow
def test_a_vllm_url_nothing_answers_stops_before_sft_with_exit_2(tmp_path):
    r, took = _train(tmp_path, "rollout.engine=vllm", "rollout.engine.urls=[http://127.0.0.1:9]")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rollout.engine.urls: 1 of 1 vLLM servers do not answer: http://127.0.0.1:9" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert took < 60, took
    assert not (tmp_path / "runs").exists()
