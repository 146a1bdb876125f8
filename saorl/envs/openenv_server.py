"""An OpenEnv server that saorl starts on loopback (``env.options.module``) and stops after the run.

``module`` names the server's ASGI app the way uvicorn does (``my_env.server.app:app``: the FastAPI
app OpenEnv's ``create_app`` makes). The first episode a process plays starts one server for that
process: ``python -m uvicorn``-style, on 127.0.0.1 and a free port, with the working directory and
``PYTHONPATH`` of this process (so a module importable here is importable there); the process waits
for its ``/health`` (``start_timeout_s``). The server dies with the process that started it: it is
stopped when that process exits (``atexit``), and a watcher in the server ends it if that process is
killed (:mod:`saorl.parent_death`). A server that exits while starting is an error quoting the end
of its output.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

_SERVERS: dict[str, LocalServer] = {}
_LOCK = threading.Lock()

_CHILD = ("import sys; from saorl.parent_death import die_with_parent; "
          "die_with_parent(int(sys.argv[1]), False); import uvicorn; "
          "uvicorn.run(sys.argv[2], host='127.0.0.1', port=int(sys.argv[3]), log_level='warning')")


class OpenEnvServerError(RuntimeError):
    """A server that could not be started, or an OpenEnv server that failed an episode."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One uvicorn process serving ``module`` on loopback."""

    def __init__(self, module: str, start_timeout_s: float) -> None:
        self.module, self.port = module, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="saorl-openenv-", suffix=".log", delete=False)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path[1:]])
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(os.getpid()), module, str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait(start_timeout_s)

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OpenEnvServerError(f"the OpenEnv server of env.options.module={self.module!r} exited "
                                         f"with status {self.proc.returncode} while starting: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise OpenEnvServerError(f"the OpenEnv server of env.options.module={self.module!r} did not answer "
                                 f"{self.url}/health within {timeout_s:g} s: {self.tail()}")

    def tail(self, chars: int = 600) -> str:
        try:
            with open(self.log.name, encoding="utf-8", errors="replace") as f:
                text = f.read()[-chars:].strip()
        except OSError:
            text = ""
        return " | ".join(text.splitlines()) or "(no output)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def local_url(module: str, start_timeout_s: float) -> str:
    """The URL of this process's server of ``module``, started on first use (again if it died)."""
    with _LOCK:
        server = _SERVERS.get(module)
        if server is None or not server.alive():
            if server is not None:
                server.stop()
            server = _SERVERS[module] = LocalServer(module, start_timeout_s)
        return server.url


def stop_all() -> None:
    """Stop every server this process started (also at exit)."""
    with _LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


atexit.register(stop_all)
