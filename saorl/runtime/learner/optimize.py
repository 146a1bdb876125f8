"""The optimizer routine of every trainer stage: accumulate over micro-batches, one finite step.

RL's critic and policy updates (:class:`~saorl.runtime.learner.single.Learner`), the SFT warm start
(:mod:`saorl.stages.sft`) and value pretraining (:mod:`saorl.stages.value_pretrain`) all take
their optimizer steps through :func:`update`:

1. every micro-batch's loss — already weighted by its share of the batch-wide denominator
   (:meth:`Updater.token_total`), so the summed losses are the batch's token mean — is
   back-propagated as soon as it is computed, so one pass's activations are alive at a time;
2. the accumulated gradients are clipped and applied in one step — unless the summed loss or the
   gradient norm is not finite, or the step would leave a parameter non-finite, in which case
   nothing reaches the weights (the step is tried first, :mod:`saorl.runtime.learner.nonfinite`) and
   ``None`` is returned in place of the gradient norm.

An :class:`Updater` says how those pieces run in this process. The one here is a single process;
the sharded trainer's (:class:`~saorl.runtime.learner.shard_update.ShardedUpdater`) counts tokens over
every rank, adds idle passes so every rank runs as many as the busiest, splits minibatches between
the ranks and decides a skip on every rank at once. A stage written against an ``Updater`` runs
sharded when it is given the sharded one. :func:`prepare_share` is how every stage turns its share
of a minibatch into the passes :func:`update` takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from saorl.data.batch import Batch, collate
from saorl.data.packing import MicroBatch, microbatches
from saorl.data.trajectory import Trajectory
from saorl.runtime.learner.nonfinite import trial_step

Tensor = torch.Tensor
T = TypeVar("T")


class Updater:
    """How the optimizer routine runs in one process (the sharded trainer has its own)."""

    world = 1
    """Processes that share each minibatch."""
    moved: float | None = None
    """The last step's relative parameter movement ``‖θ_after − θ_before‖ / ‖θ_before‖`` (None
    before a step was taken)."""

    def share(self, items: Sequence[T], lengths: Sequence[int] | None = None) -> list[T]:
        """This process's part of a minibatch every process holds (``lengths``: its items' tokens,
        what the sharded updater balances; here: all of it)."""
        return list(items)

    def passes(self, micro: list[MicroBatch], pad_id: int, device: str | torch.device,
               packing: bool) -> list[MicroBatch]:
        """The model passes of this process's micro-batches (here: the micro-batches)."""
        return micro

    def token_total(self, mask: Tensor) -> Tensor:
        """The denominator of a token mean over the batch (``mask``'s sum, 0 counts as 1)."""
        return mask.sum().clamp(min=1)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the processes (here: ``values``)."""
        return list(values)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every process's ``obj`` where the metrics are computed (here: ``[obj]``)."""
        return [obj]

    def backward(self, loss: Tensor) -> None:
        """Accumulate one micro-batch's gradients; a non-finite loss is left out (the step is
        skipped anyway)."""
        if loss.requires_grad and torch.isfinite(loss):
            loss.backward()

    def step(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, total: Tensor,
             clip: float) -> float | None:
        """The clipped step on the accumulated gradients (``total``: the batch's summed loss);
        the gradient norm, or None — gradients cleared, weights as they were — when the loss, the
        norm or an updated parameter is not finite."""
        if not torch.isfinite(total):
            optimizer.zero_grad(set_to_none=True)
            return None
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return None
        finite, moved = trial_step(params, optimizer)
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not finite:
            return None
        self.moved = relative(self.sum(moved))
        return float(norm)


def relative(sums: list[float]) -> float:
    """``sqrt(moved² / total²)`` from :func:`~saorl.runtime.learner.nonfinite.trial_step`'s sums
    (0 for all-zero parameters, as LoRA's B matrices start)."""
    moved, total = sums
    return math.sqrt(moved / total) if total > 0 else (0.0 if moved == 0 else math.inf)


def no_actions(pad_id: int) -> Trajectory:
    """Two prompt tokens, no action: the batch of an empty share (a rank whose passes are all idle)."""
    return Trajectory(token_ids=[pad_id, pad_id], action_mask=[0, 0], rollout_logprobs=[0.0, 0.0],
                      rewards=[0.0, 0.0], versions=[-1, -1], prompt_len=2)


@dataclass
class Share:
    """This process's share of a minibatch, ready for :func:`update`."""

    batch: Batch
    """The share collated ``[B, T]`` (an empty share: one action-free row, :func:`no_actions`)."""
    micro: list[MicroBatch]
    """Its token-budget micro-batches (none for an empty share)."""
    passes: list[MicroBatch]
    """The model passes to run: ``micro`` and the idle ones that make every rank's count equal."""


def prepare_share(updater: Updater, items: list[Trajectory], pad_id: int, device: str | torch.device,
                  max_tokens: int, packing: bool, shared_prefix: bool = False) -> Share:
    """``items`` (this process's share, maybe empty) collated on ``device``, cut into micro-batches of
    at most ``max_tokens`` positions (``packing``: packed without padding; ``shared_prefix``: the
    common prefix once per packed row) and padded with idle passes by ``updater``: what the
    learner, SFT and value pretraining all run their passes on."""
    batch = collate(items or [no_actions(pad_id)], pad_id).to(device)
    micro = microbatches(batch, max_tokens, packing, shared_prefix) if items else []
    return Share(batch, micro, updater.passes(micro, pad_id, device, packing))


def share_of(part: Tensor, total: Tensor) -> Tensor:
    """A micro-batch's share of a batch-wide token-mean denominator (``total``, from
    :meth:`Updater.token_total`)."""
    return part.sum() / total


def update(updater: Updater, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
           passes: list[MicroBatch], loss_of: Callable[[MicroBatch], Tensor], clip: float, *,
           backward_span: Callable[[], AbstractContextManager] = nullcontext) -> tuple[Tensor, float | None]:
    """One optimizer step over ``passes`` (the module docstring): ``loss_of(mb)`` is a pass's
    loss, already weighted by its share; returns the batch's summed loss and the gradient norm
    (None: skipped). ``backward_span`` times each backward and the step (the learner's timings)."""
    optimizer.zero_grad(set_to_none=True)
    total = None
    for mb in passes:
        loss = loss_of(mb)
        with backward_span():
            updater.backward(loss)
        total = (torch.zeros((), device=loss.device) if total is None else total) + loss.detach()
    if total is None:
        total = torch.zeros(())
    with backward_span():
        return total, updater.step(params, optimizer, total, clip)
