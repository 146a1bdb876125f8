"""The community envs' packages (the ``envs`` extra) in tests: a test of an env type skips when its
package is absent, except under ``SAORL_REQUIRE_ENVS=1`` (CI, ``.ci/run``), where it fails."""

from __future__ import annotations

import importlib
import os

import pytest


def need(module: str):
    """The module ``module``, imported; a skip where it is not installed (a failure in CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("SAORL_REQUIRE_ENVS") == "1":
            pytest.fail(f"SAORL_REQUIRE_ENVS=1 but {module} cannot be imported ({e}): install the envs "
                        'extra, pip install -c constraints-cpu.txt -e ".[envs]"')
        pytest.skip(f"{module} is not installed (the envs extra): {e}")
