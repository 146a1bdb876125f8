"""The ranks of a sharded trainer: the process group, the control channel, sharded models.

``torchrun`` starts every rank with the same ``saorl train`` command; :func:`join` turns its
environment into a :class:`ShardGroup`: the default process group (NCCL on CUDA, gloo on CPU),
a second, gloo group for control messages and small CPU reductions (rank 0's commands, token
counts, finiteness flags, metrics — never through NCCL, and with a long timeout, because the
other ranks wait on it while rank 0 runs rollouts, evaluation and the stages before RL), and a
one-dimensional device mesh over all ranks for FSDP2.

Models (:func:`shard`): ``fully_shard`` on every decoder layer, on a critic's value head (kept in
float32, its own group), then on the root. Only rank 0 loads weights: the others build the same
architecture on the meta device (:func:`skeleton`, from rank 0's class and config), and after
sharding every rank receives its shards from rank 0 (:func:`fill_from_rank0`), so no rank but 0
ever holds the whole model and only rank 0 needs the model files. :func:`replica` rebuilds a
plain, unsharded model on rank 0 from a gathered state dict (for evaluation and export).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from saorl.models.critic import Critic
from saorl.models.loading import ensure_cpu_experts

CONTROL_TIMEOUT = timedelta(hours=24)
"""How long a rank waits for rank 0's next command (rank 0 may run SFT or a long evaluation)."""


class ShardError(RuntimeError):
    """A sharded trainer that cannot start (not under torchrun, an unsupported device, ...)."""


@dataclass
class ShardGroup:
    """This process's place among the trainer's ranks (module docstring)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    control: Any
    """The gloo process group for commands, objects and small CPU reductions."""
    mesh: DeviceMesh

    # ------------------------------------------------------------ control channel
    def command(self, name: str, *args: Any) -> None:
        """Rank 0: tell every other rank to run ``name(*args)`` (see :meth:`receive`)."""
        dist.broadcast_object_list([(name, args)], src=0, group=self.control)

    def receive(self) -> tuple[str, tuple]:
        """Ranks > 0: wait for rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return t.tolist()

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out


_GROUP: ShardGroup | None = None
_JOINED = False


def join(device: str) -> ShardGroup:
    """Join the trainer's ranks from ``torchrun``'s environment (once per process)."""
    global _GROUP, _JOINED
    if _GROUP is not None:
        return _GROUP
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ShardError(
            "trainer.shard=fsdp2 runs one process per rank under torchrun: launch it as `torchrun "
            "--standalone --nproc-per-node N -m saorl.cli train CONFIG trainer.shard=fsdp2 ...` "
            "(or set trainer.shard=none to train in this one process)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ShardError(f"model.device={device!r} but this machine has no CUDA device")
        dev, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(dev)
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ShardError(f"trainer.shard=fsdp2 runs on 'cpu' (gloo) or 'cuda' (NCCL), "
                         f"not model.device={device!r}")
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    _GROUP = ShardGroup(dist.get_rank(), dist.get_world_size(), local, dev, control, mesh)
    _JOINED = True
    return _GROUP


def joined() -> bool:
    """Whether this process ever joined a sharded trainer's ranks (even if it has left them)."""
    return _JOINED


def active() -> bool:
    """Whether this process is a rank of a sharded trainer now (``train`` joined, not yet left)."""
    return _GROUP is not None


def current() -> ShardGroup:
    """The group :func:`join` made in this process."""
    if _GROUP is None:
        raise ShardError("no sharded trainer in this process: shard_group.join() was not called")
    return _GROUP


def leave() -> None:
    """Tear the process groups down (the end of a sharded run)."""
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = None


# ---------------------------------------------------------------------------------- models
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM or critic (the ``layers`` module list of its trunk)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            return list(module)
    raise ShardError(f"{type(model).__name__} has no `layers` module list to shard layer by layer")


def shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 in place: each decoder layer, a critic's value head, then the root."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    if isinstance(model, Critic):  # float32 while the trunk may be bf16: one dtype per group
        fully_shard(model.value_head, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fill_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor], group: ShardGroup) -> None:
    """After :func:`shard`: every rank's shards from rank 0's ``full_state`` (others pass ``{}``),
    and every buffer (rotary tables are in no state dict) copied from rank 0."""
    if group.rank != 0:
        model.to_empty(device=group.device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True,
                                                                     broadcast_from_rank0=True))
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


def describe(policy: nn.Module, critic: Critic | None, pad_id: int) -> dict[str, Any]:
    """What the other ranks need to build :func:`skeleton` s of rank 0's models (and its pad id)."""
    dtype = next(policy.parameters()).dtype
    out: dict[str, Any] = {"policy": (type(policy), policy.config), "dtype": dtype, "critic": None,
                           "pad_id": pad_id}
    if critic is not None:
        out["critic"] = (type(critic.trunk), critic.trunk.config, next(critic.trunk.parameters()).dtype)
    return out


def skeleton(description: dict[str, Any]) -> tuple[nn.Module, Critic | None]:
    """Policy and critic of rank 0's architecture and dtypes, on the meta device (no memory)."""
    cls, config = description["policy"]
    with torch.device("meta"):
        policy = cls(config).to(description["dtype"])
    critic = None
    if description["critic"] is not None:
        trunk_cls, trunk_config, trunk_dtype = description["critic"]
        with torch.device("meta"):
            trunk = trunk_cls(trunk_config).to(trunk_dtype)
        critic = Critic(trunk)  # value head made on the CPU, then moved to the trunk's (meta) device
    return policy.train(), critic


def replica(cls: type, config: Any, state: dict[str, torch.Tensor], like: nn.Module) -> nn.Module:
    """A plain model of class ``cls`` on the CPU holding ``state`` (a gathered full state dict),
    with ``like``'s buffers (those are never sharded). A critic when ``cls`` is :class:`Critic`."""
    if cls is Critic:
        trunk_cls, trunk_config = config
        with torch.device("meta"):
            trunk = trunk_cls(trunk_config)
        model: nn.Module = Critic(trunk)
    else:
        with torch.device("meta"):
            model = cls(config)
    model.load_state_dict(state, assign=True, strict=True)
    for name, buf in like.named_buffers():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buf.detach().to("cpu").clone())
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()  # assign=True loaded the LM head as a tensor of its own
    ensure_cpu_experts(model.trunk if isinstance(model, Critic) else model, "cpu")
    return model.eval()
