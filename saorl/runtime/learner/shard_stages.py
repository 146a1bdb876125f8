"""The stages before RL on every rank of a sharded trainer: SFT and value pretraining under FSDP2.

In a ``trainer.shard=fsdp2`` run rank 0 runs the stages (it alone holds the data, the models' files
and the engine); the optimizer steps of SFT (:func:`saorl.stages.sft.sft`) and of value
pretraining's fits (:func:`saorl.stages.value_pretrain.fit_critic`) run on every rank, with the
model sharded as the learner's is and each rank training its share of every minibatch through
the :class:`~saorl.runtime.learner.shard_update.ShardedUpdater`. So a policy or critic that does not fit
one device is trained where the learner trains it.

The protocol: the ranks other than 0 wait in :func:`serve_stages` for rank 0's commands — ``stage``
(a stage's training function, by name, with its data and settings: the same call on every rank),
``learner`` (build the sharded learner and serve it: the stages are over), ``close``. Rank 0 sends
``stage`` from :func:`run_sharded`, which returns the trained model gathered whole on rank 0 (for
export and held-out metrics). This module imports no stage: the stages hand their functions in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from saorl.config import SaorlConfig
from saorl.models.critic import Critic
from saorl.runtime.learner import shard_group as sg
from saorl.runtime.learner.shard_update import ShardedUpdater


def sharded_here(cfg: SaorlConfig) -> bool:
    """Whether this process's stages train on every rank of a sharded trainer: ``trainer.shard``
    is ``fsdp2`` and this is its rank 0 under ``torchrun`` (``saorl sft`` and ``saorl
    value-pretrain`` alone, or an experiment's arms, train in this process)."""
    return cfg.trainer.shard == "fsdp2" and sg.active()


def _sharded(group: sg.ShardGroup, policy, critic: Critic | None, pad_id: int | None,
             which: str) -> tuple[torch.nn.Module, dict]:
    """Rank 0's ``which`` model (``policy`` / ``critic``, the other None) sharded over the group,
    every rank's shards from rank 0 (``policy`` is sharded in place: its plain form is gone); the
    other ranks pass None and build skeletons."""
    if group.rank == 0:
        desc = sg.describe(policy if which == "policy" else critic.trunk, critic, pad_id)
    desc = group.broadcast(desc if group.rank == 0 else None)
    if group.rank != 0:
        policy, critic = sg.skeleton(desc)
    model = policy if which == "policy" else critic
    full = dict(model.state_dict()) if group.rank == 0 else {}
    sg.shard(model, group.mesh)
    sg.fill_from_rank0(model, full, group)
    return model, desc


def _whole(group: sg.ShardGroup, model: torch.nn.Module, desc: dict, which: str) -> torch.nn.Module | None:
    """The trained sharded ``model`` gathered into a plain model on rank 0 (None elsewhere)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if group.rank != 0:
        return None
    if which == "policy":
        cls, config = desc["policy"]
        return sg.replica(cls, config, state, like=model)
    trunk_cls, trunk_config, _ = desc["critic"]
    return sg.replica(Critic, (trunk_cls, trunk_config), state, like=model)


def _run_all(group: sg.ShardGroup, fn: Callable, model: torch.nn.Module | None, which: str,
             args: tuple, kwargs: dict) -> tuple:
    policy, critic = (model, None) if which == "policy" else (None, model)
    sharded, desc = _sharded(group, policy, critic, None, which)
    metrics = fn(sharded, *args, updater=ShardedUpdater(group), **kwargs)
    return _whole(group, sharded, desc, which), metrics


def run_sharded(fn: Callable, model: torch.nn.Module, *args: Any, which: str, **kwargs: Any) -> tuple:
    """Rank 0: ``fn(model, *args, updater=..., **kwargs)`` — a stage's training function, such as
    :func:`saorl.stages.sft.sft` (``which="policy"``) or
    :func:`saorl.stages.value_pretrain.fit_critic` (``which="critic"``) — on every rank, with
    ``model`` sharded over them (in place: its plain form is gone). Returns the trained model (a
    plain model, on ``model``'s device) and ``fn``'s result. The other ranks receive ``fn`` by name
    (it must be importable) and ``args`` / ``kwargs`` by value."""
    group = sg.current()
    device = next(model.parameters()).device
    conversions = getattr(model, "_weight_conversions", None)  # as loaded: as saved (HF names)
    group.command("stage", fn, which, args, kwargs)
    trained, result = _run_all(group, fn, model, which, args, kwargs)
    if conversions is not None:
        trained._weight_conversions = conversions
    return trained.to(device), result


def serve_stages(group: sg.ShardGroup, learner: Callable[[], Any] | None = None) -> None:
    """Ranks > 0: run rank 0's stage commands until ``learner`` (build it with ``learner()`` and
    serve it until rank 0 closes it) or ``close``."""
    while True:
        name, args = group.receive()
        if name == "stage":
            _run_all(group, args[0], None, *args[1:])
        elif name == "learner" and learner is not None:
            learner().follow()
            return
        elif name == "close":
            return
        else:
            raise sg.ShardError(f"rank {group.rank}: unexpected command {name!r} from rank 0 before RL")
