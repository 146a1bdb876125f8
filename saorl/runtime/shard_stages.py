"""The stages before RL on every rank of a sharded trainer: SFT and value pretraining under FSDP2.

In a ``trainer.shard=fsdp2`` run rank 0 runs the stages (it alone holds the data, the models' files
and the engine); the optimizer steps of SFT (:func:`saorl.stages.sft.sft`) and of value
pretraining's fits (:func:`saorl.stages.value_pretrain.fit_critic`) run on every rank, with the
model sharded as the learner's is and each rank training its share of every minibatch through
the :class:`~saorl.runtime.shard_update.ShardedUpdater`. So a policy or critic that does not fit
one device is trained where the learner trains it.

The protocol: the ranks other than 0 wait in :func:`serve_stages` for rank 0's commands — ``sft``,
``fit_critic`` (each with its data and settings, then the same function on every rank), ``learner``
(build the sharded learner and serve it: the stages are over), ``close``. Rank 0 sends a command
and runs its own part in :func:`sharded_sft` / :func:`sharded_fit_critic`, which return the
trained model, gathered whole on rank 0's CPU (for export and held-out metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from saorl.models.critic import Critic
from saorl.runtime import shard_group as sg
from saorl.runtime.shard_update import ShardedUpdater


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


def _sft_all(group: sg.ShardGroup, policy, demos: list, pad_id: int, kwargs: dict) -> tuple:
    from saorl.stages.sft import sft

    model, desc = _sharded(group, policy, None, pad_id, "policy")
    metrics = sft(model, demos, pad_id, updater=ShardedUpdater(group), **kwargs)
    return _whole(group, model, desc, "policy"), metrics


def _fit_all(group: sg.ShardGroup, critic: Critic | None, trajs: list, preset: Any, kwargs: dict) -> tuple:
    from saorl.stages.value_pretrain import fit_critic

    model, desc = _sharded(group, None, critic, kwargs["pad_id"], "critic")
    metrics = fit_critic(model, trajs, preset, updater=ShardedUpdater(group), **kwargs)
    return _whole(group, model, desc, "critic"), metrics


def sharded_sft(policy: torch.nn.Module, demos: list, pad_id: int, **kwargs: Any) -> tuple:
    """Rank 0: :func:`saorl.stages.sft.sft` of ``policy`` on every rank (it is sharded in place);
    returns the trained policy (a plain model) and the last step's metrics. ``kwargs``: ``sft``'s."""
    group = sg.current()
    group.command("sft", demos, pad_id, kwargs)
    trained, metrics = _sft_all(group, policy, demos, pad_id, kwargs)
    for attr in ("_weight_conversions",):  # as loaded: as saved (a Hugging Face model's names)
        if hasattr(policy, attr):
            setattr(trained, attr, getattr(policy, attr))
    return trained.to(next(policy.parameters()).device), metrics


def sharded_fit_critic(critic: Critic, trajs: list, preset: Any, **kwargs: Any) -> tuple:
    """Rank 0: :func:`saorl.stages.value_pretrain.fit_critic` of ``critic`` on every rank (it is
    sharded in place); returns the fitted critic (a plain model) and the last step's metrics."""
    group = sg.current()
    group.command("fit_critic", trajs, preset, kwargs)
    fitted, metrics = _fit_all(group, critic, trajs, preset, kwargs)
    return fitted.to(kwargs.get("device", "cpu")), metrics


def serve_stages(group: sg.ShardGroup, learner: Callable[[], Any] | None = None) -> None:
    """Ranks > 0: run rank 0's stage commands until ``learner`` (build it with ``learner()`` and
    serve it until rank 0 closes it) or ``close``."""
    while True:
        name, args = group.receive()
        if name == "sft":
            _sft_all(group, None, *args)
        elif name == "fit_critic":
            _fit_all(group, None, *args)
        elif name == "learner" and learner is not None:
            learner().follow()
            return
        elif name == "close":
            return
        else:
            raise sg.ShardError(f"rank {group.rank}: unexpected command {name!r} from rank 0 before RL")
