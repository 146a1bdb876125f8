"""The community envs' packages are an optional extra: a missing one is named, with the extra to
install, before anything runs (simulated here by hiding the module)."""

from __future__ import annotations

import sys

import pytest

from saorl.commands.envs import _run_list
from saorl.config import config_from_dict
from saorl.envs.registry import MissingExtra, resolve_env
from saorl.errors import StartupError
from saorl.stages.env_check import check_env

INSTALL = 'pip install -c constraints-cpu.txt -e ".[envs]"'


@pytest.mark.parametrize(("kind", "module", "package"), [
    ("reasoning_gym", "reasoning_gym", "reasoning-gym==0.1.25"),
    ("textarena", "textarena", "textarena==0.7.4"),
    ("openenv", "openenv", "openenv-core==0.3.0"),
])
def test_a_missing_package_stops_the_start_naming_the_extra(monkeypatch, kind, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(MissingExtra, match=rf"env '{kind}' needs the package {package}"):
        resolve_env(kind)
    with pytest.raises(StartupError) as e:
        check_env(config_from_dict({"env": {"type": kind, "options": {"x": 1}}}))
    message = str(e.value)
    assert message.startswith(f"env.type: env '{kind}' needs the package {package}, which is not installed")
    assert INSTALL in message and "\n" not in message


def test_bfcls_package_is_named_with_its_own_install_line(monkeypatch, capsys):
    """bfcl-eval is not in the envs extra: the message and the listing give pip install --no-deps."""
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)
    with pytest.raises(StartupError) as e:
        check_env(config_from_dict({"env": {"type": "bfcl"}}))
    message = str(e.value)
    assert message.startswith("env.type: env 'bfcl' needs the package bfcl-eval==2026.3.23, which is not "
                              "installed")
    assert "pip install --no-deps bfcl-eval==2026.3.23" in message and INSTALL not in message
    assert "\n" not in message
    assert _run_list() == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("bfcl "))
    assert line.endswith("[bfcl-eval==2026.3.23: not installed: pip install --no-deps bfcl-eval==2026.3.23]")


def test_a_missing_package_of_a_part_of_a_mix_is_named_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    cfg = config_from_dict({"env": {"mix": [{"type": "math_tool"},
                                            {"type": "textarena", "options": {"game": "TowerOfHanoi-v0"}}]}})
    with pytest.raises(StartupError, match=r"env 'textarena' needs the package textarena==0\.7\.4"):
        check_env(cfg)


def test_envs_list_says_which_packages_are_installed(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "textarena", None)
    assert _run_list() == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("textarena "))
    assert line.endswith(f"[textarena==0.7.4: not installed: {INSTALL}]")
    assert not any(x.startswith("math_tool ") and "installed" in x for x in lines)
