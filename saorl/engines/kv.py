"""A ragged, left-padded KV cache for continuous batching on top of HF's ``DynamicCache``.

Layout: every layer holds keys / values of shape ``[B, H, L, D]``; row ``b``'s real tokens sit
at the *right* end of the ``L`` columns, ``mask[b, l] = 1`` marks them, padding columns on the
left hold zeros (never NaN: fully-masked padding queries in a prefill may produce NaN, which
would survive ``0 * NaN`` in a later attention matmul, so they are zeroed). Positions (RoPE) are
passed explicitly per row, so a row's padding does not shift its positions.

Operations between decode steps: :func:`merge` (append newly prefilled rows, padding both sides
on the left to a common ``L``), :func:`select_rows` (drop finished rows) and :func:`trim` (drop
leading columns that are padding in every row). Every layer is a full-attention ``DynamicLayer``
(:func:`new_cache`), a sliding-window layer's too: the model's mask applies the window.

Prefix reuse (a session's next turn): :func:`row_kv` copies one row's real keys / values out of a
batch cache, :func:`from_rows` stacks such copies into a left-padded cache that a prefill of the
new tokens extends, and :func:`compact` moves each row's real columns to the right end again
(the new tokens of rows with fewer of them leave padding between the old tokens and the new).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention"})
"""The decoder layer types the engine's cache serves (``config.layer_types``; none listed: full)."""


def check_supported(config) -> None:
    """ValueError for a model with layers of another kind than :data:`ATTENTION_KINDS` (linear
    attention, state-space layers, chunked attention): the left-padded cache cannot hold them."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ()) - ATTENTION_KINDS
    if kinds:
        raise ValueError(f"LocalEngine serves full- and sliding-window-attention layers only; "
                         f"{type(text).__name__} has {sorted(kinds)} layers")


def new_cache(config) -> DynamicCache:
    """An empty cache of one full-attention ``DynamicLayer`` per decoder layer, sliding-window layers
    included: such a layer keeps every key here, and the model's sliding-window mask hides those
    outside the window. That mask counts cache columns, which are the tokens' distances as long as
    each row's real tokens are contiguous (:func:`compact`; a prefill on top of stored rows keeps
    them so for a model with a window: :func:`sliding_window`)."""
    cache = DynamicCache()
    cache.layers = [DynamicLayer() for _ in range(config.get_text_config(decoder=True).num_hidden_layers)]
    return cache


def kv_per_token(config) -> int:
    """Keys and values one token's KV row holds across the model's layers (elements, not bytes)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim


def sliding_window(config) -> int | None:
    """The model's sliding window (tokens), if any of its layers has one."""
    text = config.get_text_config(decoder=True)
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return None
    return getattr(text, "sliding_window", None)


def _set(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer.keys, layer.values = keys, values
    layer.device = keys.device
    layer.is_initialized = True


def zero_padding(cache: DynamicCache, mask: torch.Tensor) -> None:
    """Zero keys / values where ``mask`` ([B, L]) is 0, in place."""
    keep = mask.bool()[:, None, :, None]
    for layer in cache.layers:
        _set(layer, torch.where(keep, layer.keys, 0.0), torch.where(keep, layer.values, 0.0))


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - t.shape[-2]
    return F.pad(t, (0, 0, extra, 0)) if extra else t


def merge(
    cache: DynamicCache, mask: torch.Tensor, new_cache: DynamicCache, new_mask: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """Rows of ``new_cache`` appended after those of ``cache``; returns (cache, mask [B+b, L'])."""
    length = max(mask.shape[1], new_mask.shape[1])
    for layer, new in zip(cache.layers, new_cache.layers):
        _set(
            layer,
            torch.cat([_left_pad(layer.keys, length), _left_pad(new.keys, length)]),
            torch.cat([_left_pad(layer.values, length), _left_pad(new.values, length)]),
        )
    mask = torch.cat(
        [F.pad(mask, (length - mask.shape[1], 0)), F.pad(new_mask, (length - new_mask.shape[1], 0))]
    )
    return cache, mask


def select_rows(cache: DynamicCache, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep only ``rows`` (long [b]) of the cache, in place; returns the matching mask."""
    for layer in cache.layers:
        _set(layer, layer.keys[rows], layer.values[rows])
    return mask[rows]


def trim(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop leading columns that are padding in every row, in place; returns the new mask."""
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    if start == 0:
        return mask
    for layer in cache.layers:
        _set(layer, layer.keys[:, :, start:], layer.values[:, :, start:])
    return mask[:, start:]


RowKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One sequence's keys and values, ``[H, L, D]`` each, per layer."""


def row_kv(cache: DynamicCache, row: int, length: int) -> RowKV:
    """Copies of row ``row``'s last ``length`` columns (its real tokens), ``[H, length, D]`` per layer."""
    return [(layer.keys[row, :, -length:].clone(), layer.values[row, :, -length:].clone())
            for layer in cache.layers]


def from_rows(config, rows: list[RowKV | None]) -> tuple[DynamicCache, torch.Tensor]:
    """A cache of the given rows (each from :func:`row_kv`; None = no past, all padding),
    left-padded to the longest; returns ``(cache, mask [B, L])``. At least one row is not None."""
    some = next(r for r in rows if r is not None)
    length = max(r[0][0].shape[-2] for r in rows if r is not None)
    cache = new_cache(config)
    for i, layer in enumerate(cache.layers):
        keys = some[i][0]
        empty = keys.new_zeros(keys.shape[0], 0, keys.shape[-1])
        _set(layer, torch.stack([_left_pad(empty if r is None else r[i][0], length) for r in rows]),
             torch.stack([_left_pad(empty if r is None else r[i][1], length) for r in rows]))
    sizes = torch.tensor([0 if r is None else r[0][0].shape[-2] for r in rows], device=some[0][0].device)
    mask = (torch.arange(length, device=sizes.device)[None] >= (length - sizes)[:, None]).long()
    return cache, mask


def compact(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Move every row's real columns to the right end (order kept), in place; returns the new mask."""
    order = torch.argsort(mask, dim=1, stable=True)  # padding (0) first, then the real tokens in order
    if torch.equal(order, torch.arange(mask.shape[1], device=mask.device).expand_as(order)):
        return mask
    for layer in cache.layers:
        idx = order[:, None, :, None].expand_as(layer.keys)
        _set(layer, layer.keys.gather(2, idx), layer.values.gather(2, idx))
    return mask.gather(1, order)
