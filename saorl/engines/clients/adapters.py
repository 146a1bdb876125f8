"""LoRA adapters on the inference servers (vLLM, SGLang): the name each published version is loaded
under, how many stay loaded, and what a worker that fell behind does.

Names (:func:`adapter_name`): ``saorl-<8 hex of the run's weights directory>-<directory name>``,
e.g. ``saorl-1a2b3c4d-v00000003-adapter``, so two runs sharing a server never take each other's
adapters, and a worker derives the name from the announced directory alone; the version is in the
name (:func:`adapter_version`).

The publisher (:class:`saorl.runtime.weights.servers.ServerPublisher`) keeps the newest
:data:`KEEP_LOADED` adapters loaded and unloads older ones, so a server's adapter memory stays
bounded (SGLang's ``--max-loaded-loras`` must hold that many, and vLLM's CPU cache of
``--max-cpu-loras`` evicts beyond it).

A worker behind. A worker names the adapter of the newest version it has read; one that read it
:data:`KEEP_LOADED` or more publications ago (a long episode between two turns, a slow file
system) names an adapter the server has unloaded: vLLM answers 404 (``The model `…` does not
exist.``), SGLang 400 (``The following requested LoRA adapters are not loaded: …``). Failing the
episode for that would waste it, so the client asks that server which adapters it has
(``GET /v1/models``: both list every loaded adapter, ``id`` its name), takes the newest one of
this run (:func:`newest_loaded`) and sends the request once more under that name. Its tokens are
tagged with that adapter's version, exactly (the adapter named is the version), and the client
names it from then on, until a newer announcement. Counted in ``stats()["adapter_retries"]``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from saorl.engines.base import EngineError
from saorl.engines.clients.transport import HttpTransport

KEEP_LOADED = 2
"""Adapters left loaded on each server: the newest and the one before it, which requests in flight
and a worker that has not read the newest announcement yet may still name. Two is the fewest that
keeps a worker one publication behind from ever missing; a worker further behind is taken care of
by the retry under the newest name (module docstring), so more would cost server memory for
nothing."""

_NAME = re.compile(r"saorl-([0-9a-f]{8})-v(\d{8})-adapter")


def adapter_name(path: str | Path) -> str:
    """The name the published adapter directory ``path`` is loaded under on the servers, and that
    requests for it name (module docstring)."""
    path = Path(path).resolve()
    run = hashlib.sha1(str(path.parent).encode()).hexdigest()[:8]
    return f"saorl-{run}-{path.name}"


def adapter_version(name: str) -> int | None:
    """The version in an :func:`adapter_name`; None for any other name."""
    m = _NAME.fullmatch(name)
    return int(m.group(2)) if m else None


def _run_of(name: str) -> str | None:
    m = _NAME.fullmatch(name)
    return m.group(1) if m else None


def is_missing_adapter(error: EngineError) -> bool:
    """Whether ``error`` is a server's answer to a request naming an adapter it does not have."""
    text = str(error)
    return (("HTTP 404" in text and "does not exist" in text)  # vLLM 0.32
            or ("HTTP 400" in text and "LoRA adapters are not loaded" in text))  # SGLang 0.5


async def newest_loaded(transport: HttpTransport, url: str, name: str) -> tuple[int, str] | None:
    """``(version, name)`` of the newest adapter of ``name``'s run that the server at ``url`` has
    loaded (``GET /v1/models``), newer than ``name``'s own; None when there is none."""
    run, mine = _run_of(name), adapter_version(name)
    if run is None:
        return None
    out = await transport.call("GET", "/v1/models", url=url)
    ids = [m.get("id") for m in (out or {}).get("data", []) if isinstance(m, dict)]
    found = [(adapter_version(i), i) for i in ids if isinstance(i, str) and _run_of(i) == run]
    newer = [f for f in found if f[0] is not None and (mine is None or f[0] > mine)]
    return max(newer) if newer else None
