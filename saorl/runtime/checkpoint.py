"""Run checkpoints: written atomically, never loaded half-written.

``RUN/checkpoints/step-00000050/`` holds the learner's state, ``rng.safetensors`` (torch RNG
state), ``pending.jsonl`` (trajectories finished but not yet trained) and ``manifest.json``
(step, policy version, optimizer hyper-parameters, Python RNG state, the finished-rollout
ranges, the journal segment the checkpoint continues from, counters). Everything is written into
a temporary directory that is renamed into place at the end; ``RUN/checkpoints/latest`` (a file
holding the directory name) is then replaced atomically. A directory without a manifest, or
not named by ``latest``, is never loaded.

The learner writes its own state (``learner.save_state(directory)``, read back by
``learner.load_state``). The single-process layout (:func:`save_learner_files`):
``policy.safetensors``, ``critic.safetensors`` (state dicts in the models' own names) and
``optim.safetensors`` (both optimizers' tensors, flattened by parameter index). The sharded
learner writes either the same layout (gathered to rank 0) or its ranks' shards
(:mod:`saorl.runtime.sharded`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from saorl.data.trajectory import Trajectory
from saorl.models.serialize import load_safetensors, save_safetensors_atomic

MANIFEST = "manifest.json"
SHARDS = "shards"
"""The subdirectory of a sharded learner's state (``torch.distributed.checkpoint``, one file per rank)."""


def _flatten_optimizer(sd: dict, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"{prefix}.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict, prefix: str) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        head, pid, name = key.split(".", 2)
        if head == prefix:
            state.setdefault(int(pid), {})[name] = v
    for key, v in meta["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_learner_files(directory: Path, policy: dict[str, torch.Tensor], policy_optim: dict,
                       critic: dict[str, torch.Tensor] | None = None,
                       critic_optim: dict | None = None) -> dict[str, Any]:
    """The single-process layout of a learner's state: model state dicts and optimizer state dicts
    (torch's format, parameters by index) → files in ``directory``; returns the manifest entries."""
    save_safetensors_atomic(policy, directory / "policy.safetensors")
    optim_tensors, meta = _flatten_optimizer(policy_optim, "policy")
    optim_meta = {"policy": meta}
    if critic is not None:
        save_safetensors_atomic({k: v.detach() for k, v in critic.items()}, directory / "critic.safetensors")
        t, meta = _flatten_optimizer(critic_optim, "critic")
        optim_tensors |= t
        optim_meta["critic"] = meta
    if optim_tensors:
        save_safetensors_atomic(optim_tensors, directory / "optim.safetensors")
    return {"optim": optim_meta}


def load_learner_files(directory: Path,
                       manifest: dict[str, Any]) -> tuple[dict, dict, dict | None, dict | None]:
    """``(policy, policy optimizer, critic, critic optimizer)`` state dicts of the single-process
    layout (the critic's are None when the checkpoint has none)."""
    if (directory / SHARDS).is_dir() and not (directory / "policy.safetensors").exists():
        raise ValueError(
            f"checkpoint {str(directory)!r} holds a sharded learner's state (trainer.shard_checkpoint="
            "sharded: each rank's shards, written by torch.distributed.checkpoint); resume it with "
            "trainer.shard=fsdp2 under torchrun, or have the sharded run write full checkpoints "
            "(trainer.shard_checkpoint=full) to resume in one process")
    optim_path = directory / "optim.safetensors"
    optim = load_safetensors(optim_path) if optim_path.exists() else {}
    policy = load_safetensors(directory / "policy.safetensors")
    policy_optim = _unflatten_optimizer(optim, manifest["optim"]["policy"], "policy")
    if not (directory / "critic.safetensors").exists():
        return policy, policy_optim, None, None
    critic = load_safetensors(directory / "critic.safetensors")
    return policy, policy_optim, critic, _unflatten_optimizer(optim, manifest["optim"]["critic"], "critic")


def save_checkpoint(ckpt_root: Path, step: int, learner, extra: dict[str, Any],
                    pending: list[tuple[int, Trajectory]], keep: int = 2) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final, tmp = ckpt_root / name, ckpt_root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    learner_meta = learner.save_state(tmp)
    save_safetensors_atomic({"torch": torch.get_rng_state()}, tmp / "rng.safetensors")
    with open(tmp / "pending.jsonl", "w", encoding="utf-8") as f:
        for rid, traj in pending:
            f.write(json.dumps({"rid": rid, "traj": traj.to_dict()}) + "\n")
    manifest = {
        "step": step, "version": learner.version, "nonfinite_skips": learner.nonfinite_skips,
        "learner_steps": learner.steps_done,
        **learner_meta, "python_rng": _py_rng_to_json(random.getstate()),
        "baseline": learner.baseline.state_dict(), **extra,
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / f".latest.tmp{os.getpid()}"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, ckpt_root / "latest")
    _fsync_dir(ckpt_root)
    _prune(ckpt_root, keep)
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    dirs = sorted(d for d in ckpt_root.glob("step-*") if d.is_dir())
    for d in dirs[: -max(1, keep)]:
        shutil.rmtree(d, ignore_errors=True)


def _py_rng_to_json(state) -> list:
    return [state[0], list(state[1]), state[2]]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = ckpt_root / "latest"
    if not pointer.exists():
        return None
    d = ckpt_root / pointer.read_text().strip()
    return d if (d / MANIFEST).exists() else None


def load_checkpoint(ckpt_dir: Path, learner) -> tuple[dict[str, Any], list[tuple[int, Trajectory]]]:
    """Restore the learner in place; return the manifest and the pending trajectories."""
    manifest = json.loads((ckpt_dir / MANIFEST).read_text())
    learner.load_state(ckpt_dir, manifest)
    torch.set_rng_state(load_safetensors(ckpt_dir / "rng.safetensors")["torch"])
    s = manifest["python_rng"]
    random.setstate((s[0], tuple(s[1]), s[2]))
    learner.version = int(manifest["version"])
    learner.nonfinite_skips = int(manifest["nonfinite_skips"])
    learner.steps_done = int(manifest["learner_steps"])
    learner.baseline.load_state_dict(manifest["baseline"])
    pending = []
    with open(ckpt_dir / "pending.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            pending.append((int(d["rid"]), Trajectory.from_dict(d["traj"])))
    return manifest, pending
