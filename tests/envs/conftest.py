import os

import pytest

from saorl.envs.sandbox import SandboxUnavailable, ensure_available


@pytest.fixture(scope="module")
def sandbox_ready():
    """The sandbox works here; skip outside CI if it cannot (the reason shown), fail in CI."""
    try:
        ensure_available()
    except SandboxUnavailable as e:
        if os.environ.get("CI"):
            raise  # bwrap ships with the package: a broken sandbox in CI is a failure, not a skip
        pytest.skip(f"sandbox unavailable here: {e}")


@pytest.fixture(scope="session")
def bfcl():
    """The real ``bfcl-eval``, installed --no-deps from the index into a cache (tests/envs/bfcl_site.py);
    a skip where it cannot be, except under SAORL_REQUIRE_ENVS=1 (CI), where that fails."""
    from .bfcl_site import Unavailable, ensure

    try:
        ensure()
    except (Unavailable, ImportError, OSError) as e:
        if os.environ.get("SAORL_REQUIRE_ENVS") == "1":
            pytest.fail(f"SAORL_REQUIRE_ENVS=1 but bfcl-eval cannot be installed: {e}")
        pytest.skip(f"bfcl-eval cannot be installed here: {e}")
