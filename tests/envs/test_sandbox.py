"""The sandbox contains hostile code: each attack gets a clear result and the host stays untouched."""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import os
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from saorl.envs import sandbox
from saorl.envs.sandbox import SandboxUnavailable, run_python, run_python_files

pytestmark = pytest.mark.usefixtures("sandbox_ready")


def _procs_with(marker: str) -> list[str]:
    """Host pids whose command line contains ``marker`` (no psutil: scan /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(pid)
    return found


# ---------------------------------------------------------------- normal behaviour


def test_stdout_stderr_returncode_exact():
    code = "import sys\nprint('out 1')\nprint('é', end='')\nsys.stderr.write('err 2\\n')\nsys.exit(3)"
    r = run_python(code)
    assert (r.stdout, r.stderr, r.returncode) == ("out 1\né", "err 2\n", 3)
    assert not r.timed_out and not r.truncated and r.killed_reason is None
    assert 0 < r.duration_s < 5


def test_stdin_and_importable_files():
    files = {"helper.py": "def double(x):\n    return 2 * x\n", "pkg/__init__.py": "", "pkg/m.py": "K = 7\n",
             "data.txt": "hello"}
    code = ("import helper, pkg.m\nn = int(input())\n"
            "print(helper.double(n) + pkg.m.K, open('data.txt').read())")
    r = run_python(code, stdin="5\n", files=files)
    assert (r.stdout, r.returncode) == ("17 hello\n", 0), r.stderr


def test_run_python_files_module_entry():
    files = {"calc.py": "def add(a, b):\n    return a + b\n",
             "test_calc.py": "import unittest, calc\nclass T(unittest.TestCase):\n"
                             "    def test_ok(self):\n        self.assertEqual(calc.add(2, 2), 4)\n"
                             "    def test_bad(self):\n        self.assertEqual(calc.add(2, 2), 5)\n"}
    r = run_python_files(files, ["-m", "unittest", "-q"])
    assert r.returncode == 1
    assert "FAILED (failures=1)" in r.stderr and "Ran 2 tests" in r.stderr


def test_syntax_error_reported():
    r = run_python("def f(:\n    pass\n")
    assert r.returncode == 1 and "SyntaxError" in r.stderr and r.killed_reason is None


def test_environment_is_minimal_and_secret_absent(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SAORL_TEST_SECRET", secret)
    r = run_python("import os\nprint(sorted(os.environ.items()))\nprint(open('/proc/1/environ','rb').read())")
    assert r.returncode == 0, r.stderr
    assert secret not in r.stdout and "SAORL_TEST_SECRET" not in r.stdout
    env = dict(ast.literal_eval(r.stdout.splitlines()[0]))
    assert env["HOME"] == sandbox.WORKDIR and env["PYTHONHASHSEED"] == "0"
    assert set(env) <= {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED",
                        "PYTHONUNBUFFERED", "PYTHONIOENCODING", "TMPDIR", "PWD"}


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match=r"\.\."):
        run_python("print(1)", files={"../escape.py": "x"})
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("print(1)", memory_mb=0)
    with pytest.raises(ValueError, match=r"main\.py"):
        run_python("print(1)", files={"main.py": "x"})


def test_unavailable_is_an_error_not_an_unsandboxed_run(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "_probe_state", ["bwrap broken (test)"])
    with pytest.raises(SandboxUnavailable, match="broken"):
        run_python(f"open({str(tmp_path / 'ran')!r}, 'w')")
    assert not (tmp_path / "ran").exists()


def test_concurrent_calls_are_isolated_and_cleaned(monkeypatch):
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording_mkdtemp)
    results: dict[int, object] = {}

    def one(i: int) -> None:
        code = (f"import os\nopen('mine.txt','w').write('{i}')\nprint(sorted(os.listdir('.')), "
                f"open('mine.txt').read())")
        results[i] = run_python(code, files={f"only_{i}.py": ""})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        assert results[i].stdout == f"['main.py', 'mine.txt', 'only_{i}.py'] {i}\n", results[i].stderr
    assert len(made) == 6 and not any(os.path.exists(d) for d in made)  # staging dirs removed


# ---------------------------------------------------------------- attacks


def test_no_network_to_host_loopback_listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        code = textwrap.dedent(f"""
            import socket
            s = socket.socket(); s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port})); print("CONNECTED")
            except OSError as e:
                print("errno", e.errno)
        """)
        r = run_python(code)
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody reached the host listener
    finally:
        srv.close()
    assert "CONNECTED" not in r.stdout
    assert r.stdout.strip() in (f"errno {errno.ENETUNREACH}", f"errno {errno.ECONNREFUSED}"), r.stderr


def test_no_network_to_outside_fails_fast():
    # 192.0.2.1 is TEST-NET-1 (never routed). The child refuses to even try if it sees any route or
    # non-loopback interface, so a broken namespace can never send a packet off this machine.
    code = textwrap.dedent("""
        import socket, time
        routes = open("/proc/net/route").read().splitlines()[1:]
        ifaces = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
        if routes or set(ifaces) - {"lo"}:
            print("NETWORK VISIBLE", routes, ifaces); raise SystemExit(9)
        t = time.monotonic()
        try:
            socket.create_connection(("192.0.2.1", 80), timeout=3); print("CONNECTED")
        except OSError as e:
            print("errno", e.errno, round(time.monotonic() - t, 3))
    """)
    r = run_python(code)
    assert r.returncode == 0, (r.stdout, r.stderr)
    word, code_s, took = r.stdout.split()
    assert (word, int(code_s)) == ("errno", errno.ENETUNREACH)
    assert float(took) < 0.5


def test_writes_outside_scratch_fail_and_host_unchanged(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    marker = f"saorl-sbx-test-{uuid.uuid4().hex}"
    targets = [str(victim), str(tmp_path / "new.txt"), f"/etc/{marker}", os.path.expanduser(f"~/{marker}"),
               f"/usr/{marker}", f"{Path.cwd()}/{marker}"]
    code = textwrap.dedent(f"""
        for p in {targets!r}:
            try:
                with open(p, "w") as f: f.write("pwned")
                print("WROTE", p)
            except OSError as e:
                print("denied", e.errno)
        open("ok.txt", "w").write("scratch is writable"); print(open("ok.txt").read())
    """)
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    wrote = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("WROTE ")]
    # /tmp inside the box is its own in-memory scratch: a path there (the current directory, when
    # the checkout itself lives under /tmp as in a CI clone) may be writable in the box, but the
    # write must never reach the host; everything else must be refused outright
    assert all(p.startswith("/tmp/") for p in wrote), wrote
    assert r.stdout.count("denied") + len(wrote) == len(targets)
    assert "scratch is writable" in r.stdout
    assert victim.read_text() == "original"
    assert not any(Path(t).exists() for t in targets[1:])


def test_scratch_disk_is_capped():
    r = run_python("open('big', 'wb').write(b'x' * (20 << 20))", disk_mb=4, memory_mb=256)
    assert r.returncode != 0
    assert "No space left" in r.stderr or "File too large" in r.stderr or r.returncode == -25, r.stderr


_MOUNT_CAPS = textwrap.dedent("""
    import errno, json, os, stat
    MiB = 1 << 20
    found = {}
    for line in open("/proc/self/mountinfo"):
        fields = line.split()
        point, opts = fields[4], fields[5].split(",")
        fstype = fields[fields.index("-") + 1]
        if "rw" not in opts or fstype in ("proc", "devpts") or not os.path.isdir(point):
            continue  # procfs and device nodes (/dev/null...) hold no files; devpts makes none
        st = os.statvfs(point)
        # two files, each under the per-file limit (RLIMIT_FSIZE = disk_mb): only the mount's cap
        # can stop the second one
        sizes = []
        for name in ("under", "past"):
            n = 0
            try:
                with open(os.path.join(point, name), "wb", buffering=0) as f:
                    while n < 3 * MiB:
                        n += f.write(b"x" * (64 << 10))
                sizes.append([n, 0])
            except OSError as e:
                sizes.append([n, e.errno])
        found[point] = {"fstype": fstype, "size": st.f_blocks * st.f_frsize, "writes": sizes}
    for path in ("/dev/new", "/new", "/proc/new"):
        try:
            open(path, "wb").close()
            found[path] = "created"
        except OSError as e:
            found[path] = errno.errorcode[e.errno]
    print(json.dumps(found))
""")


def test_every_writable_mount_is_capped():
    # disk_mb=4 on every writable tmpfs: 3 MiB fit, the next 3 MiB fill the mount and fail with
    # ENOSPC. Before the cap, /dev and /dev/shm were tmpfs mounts of half the host's RAM.
    r = run_python(_MOUNT_CAPS, disk_mb=4, memory_mb=256)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    mounts = {k: v for k, v in found.items() if isinstance(v, dict)}
    assert set(mounts) == {"/dev/shm", "/tmp", sandbox.WORKDIR}, mounts
    for point, m in mounts.items():
        assert m["fstype"] == "tmpfs" and m["size"] == 4 << 20, (point, m)
        (under, under_err), (past, past_err) = m["writes"]
        assert (under, under_err) == (3 << 20, 0), (point, m)
        assert past_err == errno.ENOSPC and under + past <= m["size"], (point, m)
    assert found["/dev/new"] == found["/new"] == "EROFS"
    assert found["/proc/new"] in ("EACCES", "ENOENT", "EROFS", "EPERM")


def test_fork_bomb_contained_and_reaped():
    marker = f"bomb_{uuid.uuid4().hex}"
    code = ("import os, time\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)")
    t0 = time.monotonic()
    r = run_python_files({f"{marker}.py": code}, f"{marker}.py", timeout_s=2.0, max_procs=16)
    assert r.timed_out and r.killed_reason == "timeout" and r.returncode is None
    assert time.monotonic() - t0 < 2.0 + 1.5
    assert subprocess.run(["true"], timeout=10).returncode == 0  # host can still spawn
    deadline = time.monotonic() + 2
    while _procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _procs_with(marker) == []


def test_process_count_limit():
    code = textwrap.dedent("""
        import os, time
        n = 0
        while True:
            try:
                pid = os.fork()
            except OSError as e:
                print(n, e.errno); break
            if pid == 0:
                time.sleep(5); os._exit(0)
            n += 1
    """)
    r = run_python(code, max_procs=10)
    n, err = map(int, r.stdout.split())
    assert err == errno.EAGAIN and 5 <= n <= 7  # bwrap's init, the bootstrap and main count too


def test_box_never_runs_as_host_root():
    # Host root is exempt from RLIMIT_NPROC, so the boxed program must run as another host uid.
    marker = f"uid_{uuid.uuid4().hex}"
    done: list = []
    t = threading.Thread(target=lambda: done.append(
        run_python_files({f"{marker}.py": "import time\ntime.sleep(1.5)"}, f"{marker}.py")))
    t.start()
    host_uids: set[int] = set()
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        for pid in _procs_with(marker):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                host_uids |= {int(x) for x in status.split("Uid:")[1].split("\n")[0].split()}
        time.sleep(0.05)
    t.join()
    assert done and done[0].returncode == 0
    assert host_uids and 0 not in host_uids
    if os.geteuid() != 0:
        assert host_uids == {os.geteuid()}


def test_memory_bomb():
    r = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert "allocated" not in r.stdout and r.returncode != 0
    assert r.killed_reason == "memory" and "MemoryError" in r.stderr


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert r.timed_out and r.killed_reason == "timeout" and r.returncode is None
    assert time.monotonic() - t0 < 1.0 + 1.0


def test_cpu_limit():
    # A generous wall limit: on a loaded machine 1 s of CPU can take several seconds of wall time.
    r = run_python("while True:\n    pass\n", timeout_s=30.0, cpu_s=1)
    assert not r.timed_out and r.killed_reason == "cpu" and r.returncode is not None and r.returncode < 0


def test_output_flood_truncated_with_bounded_parent_memory():
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        r = run_python(code, max_output_bytes=64_000)
        took = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.truncated and r.killed_reason == "output" and r.returncode is None
    assert r.stdout == "x" * 64_000
    assert peak < 8 << 20, f"parent peak Python memory {peak / 2**20:.1f} MiB"
    assert took < 3


def test_killing_parents_and_host_pids_does_not_reach_the_host():
    me = os.getpid()
    code = textwrap.dedent(f"""
        import os, signal
        print("pid", os.getpid(), "ppid", os.getppid())
        for target in ({me}, 1):
            try:
                os.kill(target, signal.SIGKILL); print("sent", target)
            except OSError as e:
                print("failed", target, e.errno)
        os.kill(os.getppid(), signal.SIGKILL)
        import time; time.sleep(1); print("unreachable")
    """)
    r = run_python(code)
    lines = r.stdout.splitlines()
    assert f"failed {me} {errno.ESRCH}" in lines  # host pid does not exist in the box's pid namespace
    assert "unreachable" not in r.stdout and r.returncode == -9
    assert os.getpid() == me and subprocess.run(["true"]).returncode == 0


def _record_stages(monkeypatch) -> list[str]:
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording)
    return made


def test_a_lone_surrogate_in_the_code_is_the_programs_syntax_error_and_leaves_no_staging_dir(monkeypatch):
    """Model-written code holding "\\ud800" (no UTF-8 for it): the box's Python answers with a
    SyntaxError, as it would for any file it cannot decode; nothing raises, no saorl-sbx-* dir stays."""
    made = _record_stages(monkeypatch)
    res = run_python("print('a\ud800b')", stdin="x\udfff")
    assert res.returncode == 1 and "SyntaxError: Non-UTF-8 code" in res.stderr, res.stderr
    assert len(made) == 1 and not os.path.exists(made[0])


def test_a_stage_that_fails_half_written_is_removed(monkeypatch):
    made = _record_stages(monkeypatch)
    monkeypatch.setattr(sandbox.os, "chmod", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no")))
    with pytest.raises(OSError):
        run_python("print(1)")
    assert len(made) == 1 and not os.path.exists(made[0])
