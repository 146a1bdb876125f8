"""Packed ("padding-free") model inputs, and an attention that runs one causal attention per sequence.

Packing puts several sequences end to end in one row ``[1, N]`` with no padding between them. The
sequence boundaries travel the way Hugging Face models read them for packed inputs:

- ``position_ids`` restart at 0 at every sequence (RoPE sees each sequence from position 0);
- ``attention_mask=None`` and ``use_cache=False``: from restarting position ids, the ``sdpa`` /
  ``eager`` / ``flex`` paths of ``transformers`` build a block-diagonal causal mask
  (``masking_utils.find_packed_sequence_indices``) — exact, but the attention still multiplies
  every query of the row with every key, ``N²`` work for ``Σ nᵢ²`` useful;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (cumulative lengths, int32) and ``max_length_q`` /
  ``max_length_k``: the flash-attention varlen path (``flash_attention_2/3``) uses them directly.

``sdpa_varlen`` (:data:`VARLEN`, registered with ``transformers``' ``AttentionInterface`` on import)
is ``sdpa`` with a varlen path for CPU (and any device without flash-attention): given the
cumulative lengths (or, failing those, position ids that restart) and no mask, it runs one causal
``scaled_dot_product_attention`` per sequence — sequences of equal length batched together — so
the work is ``Σ nᵢ²``. Everything else (padded batches, KV-cache decoding, a mask from the model)
goes to the stock ``sdpa`` function unchanged. Its mask function returns no mask exactly when the
stock one would build a causal mask over the whole row from position ids alone (no padding mask,
no cache offset, no extra mask function, no sliding window); the attention then splits the row
itself. :func:`use_varlen_attention` switches a model that uses ``sdpa`` to it (nothing is written
to the model's saved config: ``_attn_implementation`` is not serialised).

**Shared prefix.** Trajectories of one batch often open with the same tokens (a tools system
message, a few-shot preamble): on a multi-turn tool task of SmolLM2-135M, 299 of a prompt's 329
tokens. A packed row may hold that prefix once: ``[prefix | suffix₁ | suffix₂ | …]``, where each
suffix is a trajectory from position ``P`` (the prefix's length) on, its position ids ``P, P+1, …``
(so RoPE sees each trajectory whole). ``sdpa_varlen`` runs the prefix's causal attention once and
each suffix's queries against the prefix's keys and values followed by its own, causally. Each
trajectory's hidden states are then exactly those of the trajectory alone, and since the prefix
feeds every suffix in one graph, its gradient is the sum the copies would have received: the same
update from fewer positions. Only ``sdpa_varlen`` reads the layout; :func:`model_inputs` detects it
(suffixes start at a position > 0) and :func:`require_shared_prefix_support` refuses it for any
other attention (flash-attention would read the suffixes as separate sequences).

:func:`model_inputs` builds the keyword arguments of a model call for either layout (padded
``[B, T]`` with an attention mask, or packed ``[1, N]``) and the matching *scored* mask: position
t can be scored (a log-prob of x_t, a value V(s_t) from hidden state t-1) only where token t-1
is a real token of the same sequence.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN = "sdpa_varlen"
"""The name ``sdpa_varlen`` is registered under in ``transformers``' attention registries."""
SHARED_PREFIX = "shared_prefix_len"
"""The model-call keyword that tells ``sdpa_varlen`` a packed row starts with a shared prefix."""


def _segments(kwargs: dict, length: int) -> list[int] | None:
    """Cumulative sequence lengths of a packed row, from ``cu_seq_lens_q`` or restarting position
    ids; None when the row holds one sequence."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = [int(x) for x in cu.tolist()]
    else:
        pos = kwargs.get("position_ids")
        if pos is None or pos.shape[0] != 1 or pos.shape[-1] != length:
            return None
        starts = (torch.diff(pos[0], prepend=pos[0, :1] - 1) != 1).nonzero().flatten().tolist()
        if any(int(pos[0, s]) != 0 for s in starts):  # a shared-prefix row whose kwargs were dropped
            at = pos[0, starts].tolist()
            raise ValueError(f"a packed row's sequences restart at positions {at}, not 0: "
                             f"a shared-prefix row needs {SHARED_PREFIX!r} and cu_seq_lens_q passed down to "
                             "the attention (a model that drops them: trainer.shared_prefix=false)")
        bounds = [*starts, length] if starts and starts[0] == 0 else [0, *starts, length]
    if len(bounds) <= 2:
        return None
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seq_lens_q {bounds} does not cover the packed row of {length} tokens")
    return bounds


def _take(x: Tensor, idx: Tensor, count: int, n: int) -> Tensor:
    """``count`` sequences of ``n`` tokens at ``idx`` of a ``[1, H, N, D]`` row, as ``[count, H, n, D]``."""
    return x[0].index_select(1, idx).unflatten(1, (count, n)).transpose(0, 1)


def _varlen(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float | None,
            dropout: float, prefix: int = 0) -> Tensor:
    """Causal attention within each ``[bounds[i], bounds[i+1])`` of a ``[1, H, N, D]`` row; sequences
    of one length share one ``sdpa`` call. With ``prefix`` (= ``bounds[1]``, a shared prefix: see
    "Shared prefix" in the module docstring) every sequence after the first also attends to all of
    the first. Returns ``[1, N, H, D]``."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for s, e in itertools.pairwise(bounds[1:] if prefix else bounds):
        by_len[e - s].append(s)
    gqa = q.shape[1] != k.shape[1]
    pieces, order = [], []
    if prefix:
        idx = torch.arange(prefix, device=q.device)
        o = F.scaled_dot_product_attention(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix],
                                           is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa)
        pieces.append(o.transpose(1, 2).flatten(0, 1))
        order.append(idx)
    for n, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)).flatten()
        c = len(starts)
        qs, ks, vs = _take(q, idx, c, n), _take(k, idx, c, n), _take(v, idx, c, n)
        if prefix:  # keys: the prefix's, then the sequence's own up to the query (bottom-right causal)
            ks = torch.cat([k[:, :, :prefix].expand(c, -1, -1, -1), ks], dim=2)
            vs = torch.cat([v[:, :, :prefix].expand(c, -1, -1, -1), vs], dim=2)
            keys = torch.arange(prefix + n, device=q.device)
            mask = keys[None] <= torch.arange(n, device=q.device)[:, None] + prefix
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, dropout_p=dropout,
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, dropout_p=dropout,
                                               enable_gqa=gqa)
        pieces.append(o.transpose(1, 2).flatten(0, 1))  # [S·n, H, D]
        order.append(idx)
    out = torch.cat(pieces)
    inverse = torch.empty_like(perm := torch.cat(order))
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return out.index_select(0, inverse).unsqueeze(0)


def varlen_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[Tensor, None]:
    """``sdpa`` with a per-sequence path for packed rows (see the module docstring)."""
    bounds = None
    if attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2] > 1:
        bounds = _segments(kwargs, query.shape[2])
    prefix = int(kwargs.pop(SHARED_PREFIX, 0) or 0)
    if prefix and (bounds is None or bounds[1] != prefix or kwargs.get("sliding_window") is not None):
        raise ValueError(f"a shared prefix of {prefix} tokens needs a packed row whose first sequence is "
                         f"that prefix and no sliding window (sequence bounds {bounds})")
    if bounds is None or kwargs.get("sliding_window") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return _varlen(query, key, value, bounds, scaling, dropout, prefix), None


def varlen_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask: Tensor | None = None, use_vmap: bool = False, local_size: int | None = None,
                **kwargs) -> Tensor | None:
    """No mask where the row is causal within sequences told apart by position ids alone (the
    attention splits it); otherwise the stock ``sdpa`` mask."""
    plain = (attention_mask is None and not use_vmap and local_size is None and q_offset == 0
             and kv_offset == 0 and q_length == kv_length)
    if plain:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, use_vmap=use_vmap,
                     local_size=local_size, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention)
AttentionMaskInterface.register(VARLEN, varlen_mask)


def use_varlen_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to ``sdpa_varlen`` (in place); other implementations
    (flash-attention, eager, flex) are left alone. Returns whether it switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(VARLEN)
    return True


def honours_shared_prefix(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention reads a shared-prefix row: ``sdpa_varlen``, and no layer with a
    sliding window (such a layer takes the stock ``sdpa`` path, whose mask knows no shared prefix)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == VARLEN and not _windowed(model)


def _windowed(model: torch.nn.Module) -> bool:
    """Whether any attention layer of ``model`` has a sliding window: a layer's own setting (Gemma 2
    and 3, Qwen2's windowed layers), or a config that gives every layer one (Mistral's, which has no
    ``layer_types``)."""
    if any(getattr(m, "sliding_window", None) for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return getattr(config, "sliding_window", None) is not None and not getattr(config, "layer_types", None)


def model_inputs(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None,
                 cu_seqlens: Tensor | None = None) -> tuple[dict, Tensor]:
    """Keyword arguments of a causal-LM (or trunk) call, and the ``[B, T]`` bool *scored* mask.

    Padded: ``input_ids`` / ``attention_mask`` ``[B, T]`` (right or left padding; no holes);
    position ids come from the mask; t is scored where tokens t and t-1 are both real.
    Packed: ``input_ids`` / ``position_ids`` ``[1, N]`` with ``attention_mask=None`` and
    ``cu_seqlens`` ``[S + 1]`` (0, end of sequence 1, ..., N); t is scored unless it starts a
    sequence (t-1 belongs to the same sequence). A row with a shared prefix (its sequences after the
    first start at position ``P`` = the first's length, see "Shared prefix") adds the keyword
    :data:`SHARED_PREFIX` for ``sdpa_varlen``; its sequences' first tokens are not scored either.
    """
    check_batch(input_ids, attention_mask, position_ids, cu_seqlens)
    if attention_mask is not None:
        kw = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=positions_from_mask(attention_mask), use_cache=False)
        return kw, scored_mask(attention_mask)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
    kw = dict(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False,
              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    scored = torch.ones_like(position_ids, dtype=torch.bool)
    scored[0, cu_seqlens[:-1].long()] = False  # each sequence's first token: t-1 is not its own
    prefix = shared_prefix(position_ids, cu_seqlens)
    if prefix:
        kw[SHARED_PREFIX] = prefix
    return kw, scored


def shared_prefix(position_ids: Tensor, cu_seqlens: Tensor) -> int:
    """The shared prefix of a packed row (0: none): the first sequence's length ``P`` when the
    sequences after it start at position ``P`` (they continue it; see "Shared prefix"), checked."""
    starts = position_ids[0, cu_seqlens[:-1].long()].tolist()
    if not any(starts[1:]):
        return 0
    prefix = int(cu_seqlens[1])
    if starts[0] != 0 or any(s != prefix for s in starts[1:]):
        raise ValueError(f"a packed row's sequences start at positions {starts}: each must start at 0, or "
                         f"every one after the first at {prefix} (continuing a shared prefix of that length)")
    return prefix


def require_shared_prefix_support(model: torch.nn.Module, kwargs: dict) -> None:
    """Refuse a shared-prefix row for a model whose attention would not read it (any but
    ``sdpa_varlen``)."""
    if SHARED_PREFIX in kwargs:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl != VARLEN:
            raise ValueError(f"a packed row with a shared prefix needs the {VARLEN!r} attention, but the "
                             f"model uses {impl!r} (micro-batches with trainer.shared_prefix=false)")


def check_batch(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> None:
    """Clear errors for a malformed padded ``[B, T]`` or packed ``[1, N]`` batch."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        return
    if position_ids is None or cu_seqlens is None:
        raise ValueError("a packed batch (attention_mask=None) needs position_ids and cu_seqlens")
    if input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(f"a packed batch is one row: input_ids {tuple(input_ids.shape)} and position_ids "
                         f"{tuple(position_ids.shape)} must both be [1, N]")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 \
            or int(cu_seqlens[-1]) != input_ids.shape[1]:
        raise ValueError(f"cu_seqlens must run from 0 to N={input_ids.shape[1]}, got {cu_seqlens.tolist()}")


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """``[B, T]`` position ids: 0 at each row's first real token, counting up; padding gets 0 or the last."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def scored_mask(attention_mask: Tensor) -> Tensor:
    """``[B, T]`` bool: True where token t and token t-1 are both real (False at t = 0)."""
    mask = attention_mask.bool()
    out = torch.zeros_like(mask)
    out[:, 1:] = mask[:, 1:] & mask[:, :-1]
    return out
