"""Collating trajectories into right-padded ``[B, T]`` tensors for the trainer.

``T`` is the longest trajectory in the batch. Padding is on the right, so position ``t`` of row
``b`` is token ``t`` of trajectory ``b`` and causal models need no position-id shift. Nothing is
truncated: a trajectory longer than ``max_len`` is an error, because cutting it would silently
drop its last action tokens and the reward credited there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from saorl.data.trajectory import Trajectory

Tensor = torch.Tensor


class BatchError(ValueError):
    """Trajectories that cannot be collated (empty list, too long, bad pad id)."""


@dataclass
class Batch:
    """B trajectories, right-padded to T = the longest one.

    Padding contents are fixed (not "anything") so that a bug that reads a padded position gives
    a reproducible result; the losses still mask them out.
    """

    input_ids: Tensor
    """``[B, T]`` int64 token ids; ``pad_id`` at padding."""
    attention_mask: Tensor
    """``[B, T]`` int64, 1 for real tokens (prompt and response), 0 at padding."""
    action_mask: Tensor
    """``[B, T]`` float32, 1 at action tokens (sampled by the policy), 0 at prompt, observation
    and padding tokens."""
    response_mask: Tensor
    """``[B, T]`` float32, 1 from ``prompt_len`` to the end of the trajectory (action and
    observation tokens), 0 at prompt and padding tokens."""
    rollout_logprobs: Tensor
    """``[B, T]`` float32 log π_rollout(x_t) recorded at sampling time; 0 wherever
    ``action_mask`` is 0 (including padding)."""
    rewards: Tensor
    """``[B, T]`` float32 per-token rewards as recorded (possibly on observation tokens); 0 at padding."""
    versions: Tensor
    """``[B, T]`` int64 policy version that sampled each action token; -1 wherever
    ``action_mask`` is 0 (including padding)."""
    routes: Tensor | None = None
    """``[B, T, layers × k]`` int64 MoE routes the engine used (routing replay), -1 at padding and
    where unknown; None when no trajectory carries routes."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def __len__(self) -> int:
        return self.size

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor on ``device`` (dtypes unchanged)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: None if v is None else v.to(device, non_blocking=non_blocking)
                        for k, v in moved.items()})


def collate(trajectories: Sequence[Trajectory], pad_id: int, max_len: int | None = None) -> Batch:
    """Right-pad ``trajectories`` into a :class:`Batch`.

    Args:
        trajectories: at least one trajectory (each already validated by ``Trajectory``).
        pad_id: token id written at padding positions (the tokenizer's pad id, ≥ 0).
        max_len: if given, any trajectory longer than this raises ``BatchError`` (no truncation).
    """
    if not trajectories:
        raise BatchError("cannot collate an empty list of trajectories")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise BatchError(f"pad_id must be an int >= 0, got {pad_id!r}")
    lengths = [len(tr) for tr in trajectories]
    if max_len is not None:
        for i, (tr, n) in enumerate(zip(trajectories, lengths)):
            if n > max_len:
                raise BatchError(
                    f"trajectory {i} (task {tr.task_id!r}) has {n} tokens, more than max_len={max_len}; "
                    "saorl never truncates a trajectory at collation"
                )
    bsz, seq = len(trajectories), max(lengths)
    input_ids = torch.full((bsz, seq), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros(bsz, seq, dtype=torch.int64)
    action_mask = torch.zeros(bsz, seq, dtype=torch.float32)
    response_mask = torch.zeros(bsz, seq, dtype=torch.float32)
    logprobs = torch.zeros(bsz, seq, dtype=torch.float32)
    rewards = torch.zeros(bsz, seq, dtype=torch.float32)
    versions = torch.full((bsz, seq), -1, dtype=torch.int64)
    for b, (tr, n) in enumerate(zip(trajectories, lengths)):
        act = torch.tensor(tr.action_mask, dtype=torch.float32)
        input_ids[b, :n] = torch.tensor(tr.token_ids, dtype=torch.int64)
        attention_mask[b, :n] = 1
        action_mask[b, :n] = act
        response_mask[b, tr.prompt_len : n] = 1.0
        # The Trajectory contract already zeroes these off action tokens; enforce it regardless.
        is_act = act.bool()
        lp = torch.tensor(tr.rollout_logprobs, dtype=torch.float32)
        logprobs[b, :n] = torch.where(is_act, lp, torch.zeros_like(lp))
        rewards[b, :n] = torch.tensor(tr.rewards, dtype=torch.float32)
        versions[b, :n] = torch.where(is_act, torch.tensor(tr.versions, dtype=torch.int64), -1)
    return Batch(routes=_routes(trajectories, lengths, seq),
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        rewards=rewards,
        versions=versions,
    )


def _routes(trajectories: Sequence[Trajectory], lengths: list[int], seq: int) -> Tensor | None:
    """``[B, T, width]`` routes (-1 where a trajectory has none), or None if none has any."""
    widths = {len(tr.routes[0]) for tr in trajectories if tr.routes}
    if not widths:
        return None
    if len(widths) > 1:
        raise BatchError(f"trajectories carry routes of different widths {sorted(widths)} (layers × k)")
    out = torch.full((len(trajectories), seq, widths.pop()), -1, dtype=torch.int64)
    for b, (tr, n) in enumerate(zip(trajectories, lengths)):
        if tr.routes:
            out[b, :n] = torch.tensor(tr.routes, dtype=torch.int64)
    return out
