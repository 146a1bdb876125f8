"""MoE routes on the wire: how each server sends the experts it routed every position to.

An engine that records routing (``GenerationResult.routes``) covers every position it fed to the
model — the prompt, then each generated token but the last, so ``len(prompt) + len(tokens) - 1``
rows — and for each row the expert ids of every MoE layer, layer-major (``layers × k``: layer 0's
k slots, then layer 1's, ...). The servers send the same array, ``[positions, layers, k]``, in
one of two encodings:

- **flat** (SGLang 0.5, ``meta_info.routed_experts`` of ``/generate`` with
  ``return_routed_experts: true``): base64 of the raw little-endian int32 bytes, flattened in
  (position, layer, slot) order; the shape is not sent, so the reader needs ``positions``.
- **npy** (vLLM 0.32 ``choices[i].routed_experts`` of ``/v1/completions``, and ``saorl serve``'s
  own ``routed_experts``): base64 of a NumPy ``.npy`` file (``np.save``, no pickles), which carries
  its shape and integer dtype (uint8 for up to 256 experts, uint16 or int32 past that).

:func:`decode_routes` turns either back into ``GenerationResult.routes`` and checks it against the
request: the right number of positions, one width per row, a whole number of experts per MoE layer
when the policy's layout is known, ids in ``[0, experts)``. Anything else is an
:class:`~saorl.engines.base.EngineError` naming the server, never a silently wrong replay.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Literal

import numpy as np

from saorl.engines.base import EngineError

Encoding = Literal["flat", "npy"]


@dataclass(frozen=True)
class RouteLayout:
    """What the trainer's policy routes: ``layers`` MoE layers over ``experts`` experts each."""

    layers: int
    experts: int


def encode_flat(routes: list[list[int]]) -> str:
    """SGLang's encoding: base64 of the little-endian int32 bytes of ``routes``, row by row."""
    return base64.b64encode(np.asarray(routes, dtype="<i4").tobytes()).decode("ascii")


def encode_npy(routes: list[list[int]], layers: int, experts: int) -> str:
    """vLLM's encoding: base64 of the ``.npy`` file of ``routes`` as ``[positions, layers, k]``, in
    the narrowest unsigned dtype that holds every expert id (as vLLM's capturer picks it)."""
    arr = np.asarray(routes, dtype=np.int64).reshape(len(routes), layers, -1)
    dtype = np.uint8 if experts <= 256 else np.uint16 if experts <= 65536 else np.int32
    with io.BytesIO() as buf:
        np.save(buf, arr.astype(dtype), allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routes(payload: object, encoding: Encoding, positions: int, where: str,
                  layout: RouteLayout | None = None) -> list[list[int]]:
    """``GenerationResult.routes`` (``positions`` rows of ``layers × k`` ids) from a server's
    ``payload``; :class:`EngineError` naming ``where`` (the server and field) when it is missing,
    not valid base64 / ``.npy``, or does not fit the request or ``layout``."""
    if not isinstance(payload, str) or not payload:
        raise EngineError(f"{where}: no routed experts in the response (got {str(payload)[:60]!r}); the "
                          "run replays MoE routes (algo.routing_replay), so the server must return "
                          "them (docs/engines.md, 'Routing replay')")
    try:
        raw = base64.b64decode(payload, validate=True)
        if encoding == "flat":
            if len(raw) % 4:
                raise ValueError(f"{len(raw)} bytes is not a whole number of int32 ids")
            flat = np.frombuffer(raw, dtype="<i4")
            if positions <= 0 or flat.size % positions:
                raise ValueError(f"{flat.size} ids do not split into {positions} positions")
            arr = flat.reshape(positions, -1)
        else:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
            if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"expected an integer [positions, layers, k] array, got {arr.dtype} "
                                 f"{arr.shape}")
            if arr.shape[0] != positions:
                raise ValueError(f"{arr.shape[0]} positions, the request fed {positions}")
            if layout is not None and arr.shape[1] != layout.layers:
                raise ValueError(f"{arr.shape[1]} MoE layers, the policy has {layout.layers}")
            arr = arr.reshape(positions, -1)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise EngineError(f"{where}: malformed routed experts: {e}") from None
    _check(arr, where, layout)
    return arr.astype(np.int64).tolist()


def _check(arr: np.ndarray, where: str, layout: RouteLayout | None) -> None:
    width = arr.shape[1]
    if width == 0:
        raise EngineError(f"{where}: routed experts have no expert ids per position")
    if layout is not None:
        if width % layout.layers or not 1 <= width // layout.layers <= layout.experts:
            raise EngineError(f"{where}: {width} expert ids per position do not split into the policy's "
                              f"{layout.layers} MoE layers of at most {layout.experts} experts each: is "
                              "the server running the run's policy?")
        bad = (arr < 0) | (arr >= layout.experts)
    else:
        bad = arr < 0
    if bad.any():
        limit = f"[0, {layout.experts})" if layout is not None else ">= 0"
        raise EngineError(f"{where}: expert id {int(arr[bad][0])} is out of range (must be {limit})")
