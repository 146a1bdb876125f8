"""A learner's state in a checkpoint directory: its models' state dicts and its optimizers'.

The single-process layout (:func:`save_learner_files` / :func:`load_learner_files`): the policy in
``policy.safetensors``, the critic in ``critic.safetensors`` and both optimizers' tensors in
``optim.safetensors``, their scalars and parameter groups in the manifest. A sharded learner with
``trainer.shard_checkpoint=sharded`` writes its own layout under :data:`SHARDS` instead. The rest
of a checkpoint (manifest, RNG, pending rollouts, the journal's place) is
:mod:`saorl.runtime.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from saorl.models.serialize import load_safetensors, save_safetensors_atomic

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
