"""Token-budget micro-batches of a collated batch: packed end to end (no padding), or padded.

The trainer's math (advantages, value targets, loss masks) runs on the right-padded ``[B, T]``
:class:`~saorl.data.batch.Batch`, which is cheap; the model passes run on micro-batches, and a
micro-batch's results are scattered back into ``[B, T]``. A micro-batch is:

- **packed** (the default): several trajectories end to end in one row ``[1, N]``, ``N`` ≤ the
  token budget, no padding anywhere. Boundaries travel as per-sequence ``position_ids`` (0, 1, …
  restarting at every trajectory) and ``cu_seqlens`` (0, end of the first, …, N), which is what
  packed ("padding-free") Hugging Face models read (:mod:`saorl.models.packed`). Trajectories are
  assigned first-fit decreasing by length, so there are few rows and each is nearly full;
- **padded**: trajectories of similar length (sorted) right-padded to ``[b, T']``, ``b · T'`` ≤ the
  budget — the layout before packing, kept for models whose attention ignores restarting
  position ids.

With ``shared_prefix``, a packed row holds the batch's common prefix (a system message every
trajectory opens with) once, followed by each trajectory from there on (:mod:`saorl.models.packed`,
"Shared prefix"): the budget then counts the prefix once per row.

A trajectory longer than the budget gets a micro-batch of its own (nothing is ever truncated).
Either way micro-batch position ``(i, j)`` is token ``col[i, j]`` of trajectory ``row[i, j]``:
:meth:`MicroBatch.gather` reads a ``[B, T]`` tensor in the micro-batch's layout and
:meth:`MicroBatch.scatter` writes a result back, so callers never see the layout.

``positions`` counts what the model processes: ``N`` per packed row, ``b · T'`` per padded block.

An :class:`IdleMicroBatch` (:func:`idle_microbatch`) is a model pass of two padding tokens that
belong to no trajectory: it gathers zeros (every mask, hence every loss term, is 0) and scatters
nothing. The sharded learner runs idle passes so that every rank runs as many passes as the rank
with the most micro-batches (FSDP's collectives need every rank in every forward and backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from saorl.data.batch import Batch, BatchError

Tensor = torch.Tensor


@dataclass
class MicroBatch:
    """Some trajectories of a :class:`Batch`, in packed ``[1, N]`` or padded ``[b, T']`` layout."""

    rows: list[int]
    """The batch rows (trajectory indices) in this micro-batch, in layout order."""
    input_ids: Tensor
    """``[1, N]`` (packed) or ``[b, T']`` (padded) int64."""
    attention_mask: Tensor | None
    """Padded: ``[b, T']`` int64, 1 at real tokens. Packed: None."""
    position_ids: Tensor | None
    """Packed: ``[1, N]`` int64, each trajectory's positions 0, 1, …. Padded: None."""
    cu_seqlens: Tensor | None
    """Packed: ``[S + 1]`` int32 cumulative lengths (0, …, N). Padded: None."""
    row_index: Tensor
    """Same shape as ``input_ids``: the batch row of each position (padded: of its row)."""
    col_index: Tensor
    """Same shape as ``input_ids``: the token index within that row (padded: the column)."""

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    @property
    def positions(self) -> int:
        """Positions the model processes for this micro-batch (padding included)."""
        return int(self.input_ids.numel())

    def model_args(self) -> dict:
        """Keyword arguments for ``token_logprobs`` / ``Critic.forward`` (besides ``input_ids``)."""
        return dict(attention_mask=self.attention_mask, position_ids=self.position_ids,
                    cu_seqlens=self.cu_seqlens)

    def gather(self, x: Tensor) -> Tensor:
        """``x`` (``[B, T]``, of the batch this was cut from) in this micro-batch's layout."""
        return x[self.row_index, self.col_index]

    def scatter(self, y: Tensor, out: Tensor) -> None:
        """Write ``y`` (this layout) into ``out`` (``[B, T]``) at its positions, in place. Padded
        blocks also write their padding positions, which are padding (or past the row's end) in
        ``out`` too."""
        out[self.row_index, self.col_index] = y.to(out.dtype)


class IdleMicroBatch(MicroBatch):
    """A pass of two padding tokens of no trajectory (module docstring): a loss on it is exactly
    0 (its masks are 0), with a gradient graph through the whole model."""

    def gather(self, x: Tensor) -> Tensor:
        return x.new_zeros((*self.input_ids.shape, *x.shape[2:]))

    def scatter(self, y: Tensor, out: Tensor) -> None:
        pass


def idle_microbatch(pad_id: int, device: torch.device | str, packed: bool = True) -> IdleMicroBatch:
    """An :class:`IdleMicroBatch` in the ``packed`` or padded layout."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    zeros = torch.zeros_like(ids)
    if packed:
        return IdleMicroBatch(rows=[], input_ids=ids, attention_mask=None,
                              position_ids=torch.arange(2, device=device)[None],
                              cu_seqlens=torch.tensor([0, 2], dtype=torch.int32, device=device),
                              row_index=zeros, col_index=zeros)
    return IdleMicroBatch(rows=[], input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=None,
                          cu_seqlens=None, row_index=zeros, col_index=zeros)


def plan_packed(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows of at most ``max_tokens`` tokens, first-fit decreasing; a longer trajectory alone."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        fit = next((b for b, r in enumerate(room) if r >= n), None)
        if fit is None:
            bins.append([i])
            room.append(max_tokens - n)
        else:
            bins[fit].append(i)
            room[fit] -= n
    return bins


def plan_padded(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Blocks of similar length (longest first) with rows × longest ≤ ``max_tokens``."""
    blocks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if blocks and (len(blocks[-1]) + 1) * lengths[blocks[-1][0]] <= max_tokens:
            blocks[-1].append(i)
        else:
            blocks.append([i])
    return blocks


def shared_prefix_len(batch: Batch) -> int:
    """The longest prefix every row of ``batch`` may share in a packed row: tokens equal in every
    row, ending at least one token before any row's response (so every scored position — an
    action's log-prob, a response token's value — reads a hidden state of its own row's suffix)."""
    if batch.input_ids.shape[0] < 2:
        return 0
    ids, real = batch.input_ids, batch.attention_mask.bool()
    same = ((ids == ids[:1]) & real).all(dim=0).long().cumprod(0)
    common = int(same.sum())
    response = (batch.response_mask > 0) | (batch.action_mask > 0) | ~real
    first_each = torch.where(response.any(dim=1), response.long().argmax(dim=1), response.shape[1])
    first = int(first_each.min())  # the earliest response token of any row
    return max(0, min(common, first - 1))


def _packed(batch: Batch, rows: list[int], lengths: Sequence[int], prefix: int = 0) -> MicroBatch:
    """``rows`` end to end; with ``prefix``, the first row's first ``prefix`` tokens once, then each
    row from ``prefix`` on (see "Shared prefix" in :mod:`saorl.models.packed`)."""
    dev = batch.input_ids.device
    if len(rows) < 2:
        prefix = 0
    spans = [(r, prefix, lengths[r]) for r in rows]
    if prefix:
        spans.insert(0, (rows[0], 0, prefix))
    row_index = torch.cat([torch.full((e - s,), r, dtype=torch.long) for r, s, e in spans]).to(dev)
    col_index = torch.cat([torch.arange(s, e) for r, s, e in spans]).to(dev)
    cu = torch.tensor([0, *(e - s for r, s, e in spans)], dtype=torch.int64).cumsum(0).to(torch.int32)
    return MicroBatch(rows=rows, input_ids=batch.input_ids[row_index, col_index][None], attention_mask=None,
                      position_ids=col_index[None], cu_seqlens=cu.to(dev), row_index=row_index[None],
                      col_index=col_index[None])


def _padded(batch: Batch, rows: list[int], lengths: Sequence[int]) -> MicroBatch:
    dev = batch.input_ids.device
    width = max(lengths[r] for r in rows)
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    row_index = index[:, None].expand(len(rows), width)
    col_index = torch.arange(width, device=dev)[None].expand(len(rows), width)
    return MicroBatch(rows=rows, input_ids=batch.input_ids[index, :width],
                      attention_mask=batch.attention_mask[index, :width], position_ids=None, cu_seqlens=None,
                      row_index=row_index, col_index=col_index)


MIN_SHARED_PREFIX = 16
"""A common prefix shorter than this is not shared (the masked attention it needs costs more than
the few positions it saves)."""


def microbatches(batch: Batch, max_tokens: int, packed: bool = True,
                 shared_prefix: bool = False) -> list[MicroBatch]:
    """Cut ``batch`` into micro-batches of at most ``max_tokens`` positions (see the module
    docstring); ``shared_prefix`` (packed only): each packed row holds the batch's common prefix
    (:func:`shared_prefix_len`, when at least :data:`MIN_SHARED_PREFIX` tokens) once."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BatchError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    lengths = batch.attention_mask.sum(dim=1).tolist()
    prefix = shared_prefix_len(batch) if packed and shared_prefix else 0
    if MIN_SHARED_PREFIX <= prefix < max_tokens:
        plan = plan_packed([n - prefix for n in lengths], max_tokens - prefix)
        return [_packed(batch, rows, lengths, prefix) for rows in plan]
    plan = (plan_packed if packed else plan_padded)(lengths, max_tokens)
    make = _packed if packed else _padded
    return [make(batch, rows, lengths) for rows in plan]
