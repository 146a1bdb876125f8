"""The optimizer routine across the ranks of a sharded trainer: :class:`ShardedUpdater`.

:func:`saorl.runtime.learner.optimize.update` with this updater is what every stage's optimizer step
becomes under ``trainer.shard=fsdp2`` (RL's critic and policy updates, SFT, value pretraining):

- **shares**: each rank takes a part of every minibatch — whole groups (:func:`split_groups`:
  GRPO's groups never split), greedily balanced by tokens;
- **global token means**: a micro-batch's loss is weighted by its tokens over the *global* count
  (all-reduced once per loss) times the world size, because FSDP2 averages the ranks' gradients;
  so the ranks' accumulated gradients add up to the whole batch's token mean;
- **idle passes**: FSDP2 all-gathers parameters in every forward and reduce-scatters gradients in
  every backward, collectives every rank must join, so every rank runs as many passes as the
  busiest (:class:`~saorl.data.packing.IdleMicroBatch`: a loss of exactly 0 through the whole
  model), and every rank runs every backward, even of a non-finite loss;
- **one decision**: a non-finite loss or gradient norm on any rank, or an update that leaves a
  parameter shard non-finite on any rank (tried first, not taken), skips the step on every rank, so the ranks
  never diverge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from saorl.data.packing import MicroBatch, idle_microbatch
from saorl.runtime.learner.nonfinite import trial_step
from saorl.runtime.learner.optimize import Updater, relative
from saorl.runtime.learner.shard_group import ShardGroup

T = TypeVar("T")


def split_groups(gids: list[int], lengths: list[int], world: int) -> list[list[int]]:
    """Indices of each rank's share: whole groups (equal consecutive ``gids``), longest first to
    the rank with the fewest tokens so far; each share in batch order."""
    groups: list[list[int]] = []
    for i, g in enumerate(gids):
        if groups and gids[groups[-1][0]] == g:
            groups[-1].append(i)
        else:
            groups.append([i])
    load, shares = [0] * world, [[] for _ in range(world)]
    for members in sorted(groups, key=lambda m: -sum(lengths[i] for i in m)):
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r] += members
        load[r] += sum(lengths[i] for i in members)
    return [sorted(s) for s in shares]


class ShardedUpdater(Updater):
    """The optimizer routine on every rank of ``group`` (module docstring)."""

    def __init__(self, group: ShardGroup) -> None:
        self.group = group
        self.world = group.world

    def share(self, items: Sequence[T], lengths: Sequence[int] | None = None) -> list[T]:
        """This rank's part of a minibatch every rank holds: balanced by ``lengths`` (tokens)."""
        sizes = list(lengths) if lengths is not None else [1] * len(items)
        mine = split_groups(list(range(len(items))), sizes, self.world)[self.group.rank]
        return [items[i] for i in mine]

    def passes(self, micro: list[MicroBatch], pad_id: int, device: str | torch.device,
               packing: bool) -> list[MicroBatch]:
        """``micro`` and as many idle passes as make every rank's count the largest."""
        most = max(self.group.all_gather(len(micro)))
        return micro + [idle_microbatch(pad_id, device, packing)] * (most - len(micro))

    def token_total(self, mask: torch.Tensor) -> torch.Tensor:
        """The global count of ``mask`` (every rank's share; 0 counts as 1) over the world size:
        FSDP2 averages the ranks' gradients, so weighting by it gives the global mean's sum."""
        total = self.group.all_sum([float(mask.sum())])[0]
        return torch.tensor(max(total, 1.0) / self.world, device=mask.device)

    def sum(self, values: list[float]) -> list[float]:
        return self.group.all_sum(values)

    def gather(self, obj: Any) -> list[Any] | None:
        return self.group.gather(obj)

    def backward(self, loss: torch.Tensor) -> None:
        """Every rank runs every backward (FSDP's reduce-scatter), even of a non-finite loss: the
        step is then skipped on every rank."""
        loss.backward()

    def step(self, params, optimizer: torch.optim.Optimizer, total: torch.Tensor,
             clip: float) -> float | None:
        """The single-process step, decided the same way on every rank."""
        if self.group.all_sum([0.0 if torch.isfinite(total) else 1.0])[0]:
            optimizer.zero_grad(set_to_none=True)
            return None
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # global, the same everywhere
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return None
        finite, moved = trial_step(params, optimizer)  # of this rank's shards
        # every rank steps, or none does (even where its own shards are finite)
        finite = not self.group.all_sum([0.0 if finite else 1.0])[0]
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not finite:
            return None
        self.moved = relative(self.sum(moved))  # the whole model's, on every rank
        return norm
