"""The optional packages of the community envs: which env needs which, and the check that names the extra.

``reasoning_gym``, ``textarena`` and ``openenv`` play environments saorl does not ship, from
packages of the ``envs`` extra (``pip install -e ".[envs]"``, pinned together in pyproject.toml);
the base install stays without them. ``bfcl`` plays ``bfcl-eval``, which cannot be in that extra
(it pins numpy 1.26.4, sentence-transformers, faiss and the model vendors' SDKs, none of which its
multi-turn part uses): it is installed on its own, ``pip install --no-deps bfcl-eval==2026.3.23``
(:attr:`Extra.install`). An env class says what it needs in ``requires`` (module
names); :func:`missing_extra` is asked when the env is resolved, so a run, ``saorl config`` and
``saorl envs sample`` stop at once with one paragraph naming the extra, not inside a rollout.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Extra:
    module: str
    """The module imported (``reasoning_gym``)."""
    package: str
    """The distribution, pinned as the ``envs`` extra pins it (``reasoning-gym==0.1.25``)."""
    install: str = ""
    """The command that installs it, when it is not in the ``envs`` extra (empty: :data:`INSTALL`)."""

    @property
    def install_line(self) -> str:
        return self.install or INSTALL


EXTRAS: dict[str, Extra] = {
    "reasoning_gym": Extra("reasoning_gym", "reasoning-gym==0.1.25"),
    "textarena": Extra("textarena", "textarena==0.7.4"),
    "openenv": Extra("openenv", "openenv-core==0.3.0"),
    "bfcl": Extra("bfcl_eval", "bfcl-eval==2026.3.23", "pip install --no-deps bfcl-eval==2026.3.23"),
}
"""The community env types and the package each one plays (all but ``bfcl``'s in the ``envs`` extra)."""

INSTALL = 'pip install -c constraints-cpu.txt -e ".[envs]"'


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (a module set to None in ``sys.modules``, as tests
    do to simulate its absence, cannot)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_extra(env_type: str, modules: tuple[str, ...]) -> str | None:
    """None when every module of ``modules`` imports; else the paragraph that says what to install."""
    missing = [m for m in modules if not installed(m)]
    if not missing:
        return None
    by_module = {e.module: e for e in EXTRAS.values()}
    own = [by_module[m] for m in missing if m in by_module and by_module[m].install]
    if own:
        return (f"env {env_type!r} needs the package {own[0].package}, which is not installed: it is an "
                f"optional package of saorl that is installed on its own, without its dependencies (which "
                f"saorl does not need and which would replace packages saorl pins): {own[0].install}, then "
                "run again")
    packages = [by_module[m].package if m in by_module else m for m in missing]
    return (f"env {env_type!r} needs the package {', '.join(packages)}, which is not installed: it is "
            f"an optional extra of saorl. Install the community envs with {INSTALL} (from saorl's "
            f"source directory; or pip install {' '.join(packages)}), then run again")
