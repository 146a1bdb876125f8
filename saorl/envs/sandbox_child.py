"""The two pieces of the sandbox that run outside the parent: the in-box bootstrap, the root preexec.

``BOOT_SOURCE`` runs inside bwrap as ``python -I -S -B -c BOOT_SOURCE in_dir work_dir status_fd
AS CPU_SOFT CPU_HARD NPROC FSIZE NOFILE -- argv...``: it copies the staged input files into the
writable work dir, forks, applies the rlimits in the child (CORE is always 0), closes the status
fd there and execs ``argv``; the parent writes the child's raw wait status (decimal) to the status
fd so the host learns the exact exit code or signal (bwrap itself only reports 128+signal).

:func:`make_preexec` is for a root caller: a process whose real uid is host root is exempt from
RLIMIT_NPROC, so bwrap must start under an unprivileged uid. That uid cannot traverse e.g. a 0700
``/root`` holding the interpreter, so the forked child first enters a private mount namespace and
bind-mounts those prefixes onto traversable staging dirs (bwrap binds them back to their real
paths inside the box). Only the child's own namespace changes; the host's mounts do not.
"""

from __future__ import annotations

import ctypes
import os
import stat

LIMIT_NAMES = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE")

BOOT_SOURCE = r"""
import os, resource, sys
src, dst, status_fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
mem, cpu_soft, cpu_hard, nproc, fsize, nofile = map(int, sys.argv[4:10])
argv = sys.argv[11:]
for root, dirs, names in os.walk(src):
    rel = os.path.relpath(root, src)
    out = os.path.join(dst, rel) if rel != "." else dst
    os.makedirs(out, exist_ok=True)
    for n in names:
        with open(os.path.join(root, n), "rb") as fi, open(os.path.join(out, n), "wb") as fo:
            fo.write(fi.read())
pid = os.fork()
if pid == 0:
    try:
        os.close(status_fd)
        R = resource
        for lim, val in ((R.RLIMIT_AS, (mem, mem)), (R.RLIMIT_CPU, (cpu_soft, cpu_hard)),
                         (R.RLIMIT_NPROC, (nproc, nproc)), (R.RLIMIT_FSIZE, (fsize, fsize)),
                         (R.RLIMIT_NOFILE, (nofile, nofile)), (R.RLIMIT_CORE, (0, 0))):
            R.setrlimit(lim, val)
        os.execv(argv[0], argv)
    except BaseException as e:
        os.write(2, ("sandbox bootstrap: %r\n" % (e,)).encode())
    os._exit(127)
_, st = os.waitpid(pid, 0)
os.write(status_fd, str(st).encode())
"""

_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


def untraversable(path: str) -> bool:
    """True if a uid with only 'other' permissions cannot reach and list ``path``."""
    parts = os.path.abspath(path).split("/")
    for i in range(2, len(parts) + 1):
        mode = os.stat("/".join(parts[:i]) or "/").st_mode
        if not mode & stat.S_IXOTH:
            return True
    return not os.stat(path).st_mode & stat.S_IROTH


def make_preexec(uid: int, staged: dict[str, str]):
    """A ``preexec_fn``: bind-mount ``staged`` (real path → staging dir) privately, then drop to ``uid``."""
    libc = ctypes.CDLL(None, use_errno=True)
    mounts = [(src.encode(), dst.encode()) for src, dst in staged.items()]

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox preexec: {what}: {os.strerror(err)}")

    def preexec() -> None:
        if mounts:
            check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
            for src, dst in mounts:
                check(libc.mount(src, dst, None, _MS_BIND | _MS_REC, None), f"bind {src!r}")
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    return preexec
