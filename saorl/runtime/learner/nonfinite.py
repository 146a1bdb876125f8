"""The non-finite guard around an optimizer step: try it a chunk at a time, then take it.

A step with a finite loss and a finite gradient norm can still leave a parameter non-finite (a
huge learning rate, an optimizer state that overflowed). Such a step must never reach the
weights, so the learners (:class:`~saorl.runtime.learner.single.Learner` and, on every rank,
:class:`~saorl.runtime.learner.sharded.ShardedLearner`) step like this::

    finite, sums = trial_step(params, optimizer)   # nothing changes; the sharded learner
    if finite:                                     # all-reduces the verdict
        optimizer.step()

:func:`trial_step` takes the optimizer's step **a chunk of parameters at a time** (the optimizer's
param groups narrowed to the chunk, their settings kept): the chunk's parameters and optimizer
state are copied into one buffer (allocated for the step, freed after it) and the step lands on
the copies (each parameter's ``data`` swapped for its copy for the while; a sharded ``DTensor``
is stepped in place and copied back instead), which are checked and measured, and the state a
first step created is dropped again. So the guard
holds one chunk's copy (about :data:`CHUNK_BYTES`, or one parameter with its state when that is
larger), and only during the step, not a second copy of the model and its AdamW moments kept for
good: on SmolLM2-135M that copy was 2.4 GB of the trainer's 7 GB. The price is the optimizer's
arithmetic twice (the trial, then the step).
The step taken after the trial is the plain ``optimizer.step()``, whose per-element arithmetic
the trial repeated exactly (the optimizers are element-wise), so a guarded step equals an
unguarded one bit for bit, and a step that would go non-finite is never taken at all.

The check is one sum per parameter tensor (20x cheaper than ``isfinite().all()``): inf or NaN
anywhere makes a sum non-finite, and so does a sum past the dtype's range (weights of 1e32 and up
in float32), which is rightly refused too. A sharded (FSDP2) parameter is a ``DTensor``: each rank
tries, checks and restores its own shard.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

CHUNK_BYTES = 64 * 2**20
"""Parameters and optimizer state tried at once (one parameter larger than this is tried alone)."""

_ALIGN = 64


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (a view: writing into it writes the parameter), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_tensors(optimizer: torch.optim.Optimizer, p) -> list[torch.Tensor]:
    return [v for v in optimizer.state[p].values() if torch.is_tensor(v)] if optimizer.state.get(p) else []


def _tensors(optimizer: torch.optim.Optimizer, chunk: list, had_state: list) -> list[torch.Tensor]:
    """The (local) parameters of ``chunk``, then the state tensors of those in ``had_state``."""
    state = [s for p in had_state for s in _state_tensors(optimizer, p)]
    return [_local(t.detach()) for t in [*chunk, *state]]


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def chunks(params, optimizer: torch.optim.Optimizer, limit: int = CHUNK_BYTES) -> list[list]:
    """``params`` in order, cut into runs whose parameters and optimizer state hold at most
    ``limit`` bytes (a parameter larger than that alone)."""
    out: list[list] = []
    size = 0
    for p in params:
        n = sum(_nbytes(t) for t in [p, *_state_tensors(optimizer, p)])
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets (64-byte aligned) of ``tensors`` packed one after another, and the bytes in all."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def _views(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the byte buffer ``buf`` shaped like ``tensors``."""
    offsets, _ = _layout(tensors)
    return [buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors)]


def _step_only(optimizer: torch.optim.Optimizer, chunk: list) -> None:
    """``optimizer.step()`` on the parameters of ``chunk`` alone (each group's settings kept)."""
    inside = {id(p) for p in chunk}
    groups = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in inside]
        optimizer.step()
    finally:
        for g, kept in zip(optimizer.param_groups, groups):
            g["params"] = kept


@contextlib.contextmanager
def _stepped_on_copies(optimizer: torch.optim.Optimizer, chunk: list, had_state: list,
                       copies: list[torch.Tensor]) -> Iterator[None]:
    """For the block, the chunk's parameters hold ``copies`` (``p.data``) and its optimizer state
    is made of them, so a step lands on the copies; the real tensors are back after, untouched."""
    datas = [p.data for p in chunk]
    states = {p: optimizer.state[p] for p in had_state}
    rest = iter(copies[len(chunk):])
    try:
        for p, c in zip(chunk, copies):
            p.data = c
        for p, st in states.items():
            optimizer.state[p] = {k: next(rest) if torch.is_tensor(v) else copy.copy(v)
                                  for k, v in st.items()}
        yield
    finally:
        for p, d in zip(chunk, datas):
            p.data = d
        _drop_new_state(optimizer, chunk, had_state)
        for p, st in states.items():
            optimizer.state[p] = st


@contextlib.contextmanager
def _stepped_in_place(optimizer: torch.optim.Optimizer, chunk: list, had_state: list,
                      copies: list[torch.Tensor]) -> Iterator[None]:
    """For the block, a step lands on the real tensors (a DTensor's shard cannot be swapped for a
    copy); after it, they are copied back from ``copies``."""
    others = {(p, k): copy.copy(v) for p in had_state for k, v in optimizer.state[p].items()
              if not torch.is_tensor(v)}
    try:
        yield
    finally:
        _drop_new_state(optimizer, chunk, had_state)
        for (p, k), v in others.items():
            optimizer.state[p][k] = v
        with torch.no_grad():
            torch._foreach_copy_(_tensors(optimizer, chunk, had_state), copies)


def _drop_new_state(optimizer: torch.optim.Optimizer, chunk: list, had_state: list) -> None:
    """The state a first step created for the parameters of ``chunk`` that had none, dropped."""
    stateful = {id(p) for p in had_state}
    for p in chunk:
        if id(p) not in stateful:
            optimizer.state.pop(p, None)


def trial_step(params, optimizer: torch.optim.Optimizer,
               limit: int = CHUNK_BYTES) -> tuple[bool, list[float]]:
    """Whether ``optimizer.step()`` would leave every (local) parameter of ``params`` finite, and
    the step's movement sums ``[Σ ‖θ_after − θ_before‖², Σ ‖θ_before‖²]`` (the caller sums them
    over the ranks: ``policy/update_rel`` is the root of their ratio; zeros when not finite),
    found by taking it a chunk at a time on copies (module docstring). Parameters and optimizer
    state are left bit for bit as they were; the gradients are kept for the real step."""
    moved = torch.zeros((), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    runs = chunks(params, optimizer, limit)
    if not runs:
        return True, [0.0, 0.0]
    # one buffer for the largest chunk, reused by every chunk, freed on return
    largest = max(_layout(_tensors(optimizer, c, c))[1] for c in runs)
    buf = torch.empty(largest, dtype=torch.uint8, device=_local(runs[0][0]).device)
    for chunk in runs:
        had_state = [p for p in chunk if optimizer.state.get(p)]
        tensors = _tensors(optimizer, chunk, had_state)
        copies = _views(buf, tensors)
        torch._foreach_copy_(copies, tensors)
        swap = not any(hasattr(p, "to_local") for p in chunk)
        n = len(chunk)
        before = tensors[:n] if swap else copies[:n]
        with (_stepped_on_copies if swap else _stepped_in_place)(optimizer, chunk, had_state, copies):
            _step_only(optimizer, chunk)
            with torch.no_grad():
                after = [_local(p.detach()) for p in chunk]
                finite = bool(torch.stack([a.sum() for a in after]).isfinite().all())
                if finite:
                    moved += torch.stack([torch.linalg.vector_norm((a - b).float()) ** 2
                                          for a, b in zip(after, before)]).sum().cpu().double()
                    total += torch.stack([torch.linalg.vector_norm(b.float()) ** 2
                                          for b in before]).sum().cpu().double()
        if not finite:
            return False, [0.0, 0.0]
    return True, [float(moved), float(total)]
