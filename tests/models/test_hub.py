"""Hub model ids: taken from the local Hugging Face cache offline, a one-paragraph error otherwise."""

import shutil

import huggingface_hub.constants as hub_constants
import pytest
from model_families import qwen3_dir

from saorl.config import ModelConfig
from saorl.models.codec import run_tokenizer
from saorl.models.loading import load_policy
from saorl.models.source import ModelSourceError, parse, resolve_source


def is_hub_id(spec: str) -> bool:
    try:
        return parse(spec).kind == "hub"
    except ModelSourceError:
        return False


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in ``tmp_path`` and no Hub access (as on this machine)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def _cache_snapshot(cache, repo_id, src):
    """Lay ``src`` out in ``cache`` as the Hub client stores a downloaded snapshot of ``repo_id``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_hub_id_shape():
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("meta-llama/Llama-3.2-1B")
    for not_hub in ("tiny-moe", "a/b/c", "../x", "/x/y", "./x"):
        assert not is_hub_id(not_hub), not_hub


def test_offline_hub_id_not_in_cache_is_one_clear_paragraph(offline_cache):
    with pytest.raises(ModelSourceError) as err:
        load_policy("saorl-tests/not-cached-anywhere")
    msg = str(err.value)
    assert "\n" not in msg
    assert "not in the local Hugging Face cache" in msg and "cannot be reached" in msg
    assert "hf download saorl-tests/not-cached-anywhere --local-dir DIR" in msg and "policy=DIR" in msg


def test_a_missing_path_is_not_looked_up_on_the_hub(tmp_path, offline_cache):
    with pytest.raises(ModelSourceError, match=r"does not exist .* not a Hugging Face Hub model id"):
        resolve_source(str(tmp_path / "no" / "such" / "dir"))


def test_cached_hub_model_and_its_tokenizer_load_offline(tmp_path, offline_cache):
    snapshot = _cache_snapshot(offline_cache, "saorl-tests/qwen3-mini", qwen3_dir(tmp_path / "src"))
    assert resolve_source("saorl-tests/qwen3-mini") == snapshot
    policy = load_policy("saorl-tests/qwen3-mini")
    assert type(policy).__name__ == "Qwen3ForCausalLM"
    tok = run_tokenizer(ModelConfig(policy="saorl-tests/qwen3-mini"))
    assert tok.spec.source == str(snapshot) and tok.applies_chat_template  # the model's own, local
