import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from saorl.models import serialize
from saorl.models.critic import Critic
from saorl.models.loading import load_policy
from saorl.models.serialize import (
    export_policy,
    load_critic,
    load_safetensors,
    save_critic,
    save_safetensors_atomic,
)
from saorl.models.tokenizer import load_tokenizer


def test_round_trip_tied_noncontiguous(tmp_path):
    w = torch.randn(4, 3)
    tensors = {"a": w, "tied": w, "view": w[:2], "t": w.t(), "i": torch.arange(5)}
    path = save_safetensors_atomic(tensors, tmp_path / "x.safetensors")
    got = load_safetensors(path)
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
    assert os.listdir(tmp_path) == ["x.safetensors"]
    with pytest.raises(TypeError, match="'bad' is a list"):
        save_safetensors_atomic({"bad": [1, 2]}, tmp_path / "y.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_safetensors(tmp_path / "missing.safetensors")


def test_interrupted_save_keeps_previous_file(tmp_path, monkeypatch):
    dest = tmp_path / "ckpt.safetensors"
    save_safetensors_atomic({"w": torch.zeros(3)}, dest)
    real_save = serialize.save_file

    def crash_midway(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # leave a truncated file behind, then die
            f.truncate(os.path.getsize(filename) // 2)
        raise OSError("disk full")

    monkeypatch.setattr(serialize, "save_file", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors_atomic({"w": torch.ones(1000)}, dest)
    assert torch.equal(load_safetensors(dest)["w"], torch.zeros(3))
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


@pytest.mark.parametrize("kind", ["tiny-moe", "tiny-dense"])
def test_export_policy_loads_with_identical_logits(tmp_path, kind):
    model, tok = load_policy(kind, seed=4), load_tokenizer()
    out = export_policy(model, tok, tmp_path / "policy")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tok.encode("def f(x): return x + 1")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    tok2 = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok2.encode("hello 123") == tok.encode("hello 123")
    assert (tok2.eos_token_id, tok2.pad_token_id) == (0, 1)


def test_export_replaces_and_interrupted_export_keeps_previous(tmp_path):
    tok = load_tokenizer()
    out = tmp_path / "policy"
    export_policy(load_policy("tiny-dense", seed=1), tok, out)
    export_policy(load_policy("tiny-dense", seed=2), tok, out)
    assert os.listdir(tmp_path) == ["policy"]
    second = AutoModelForCausalLM.from_pretrained(str(out)).model.norm.weight.clone()

    class Exploding:
        def save_pretrained(self, path):
            (torch.save(torch.zeros(1), os.path.join(path, "partial.bin")))
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        export_policy(load_policy("tiny-dense", seed=3), Exploding(), out)
    assert os.listdir(tmp_path) == ["policy"]
    assert "partial.bin" not in os.listdir(out)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(str(out)).model.norm.weight, second)


@pytest.mark.parametrize("kind", ["tiny-moe", "tiny-dense"])
def test_critic_round_trip(tmp_path, kind):
    critic = Critic.from_policy(kind, seed=7)
    with torch.no_grad():  # move every weight off its seeded init, so a re-init cannot pass
        for p in critic.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_critic(critic, tmp_path / "critic")
    assert sorted(os.listdir(tmp_path / "critic")) == ["config.json", "critic.json", "critic.safetensors"]
    loaded = load_critic(tmp_path / "critic")
    assert type(loaded.trunk) is type(critic.trunk)
    ids = torch.randint(2, 1024, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        assert torch.equal(critic(ids, mask), loaded(ids, mask))
    if kind == "tiny-moe":
        assert loaded.trunk.config._experts_implementation == "grouped_mm"


def test_load_critic_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_critic(tmp_path / "nope")
    (tmp_path / "c").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_critic(tmp_path / "c")
    save_critic(Critic.from_policy("tiny-dense"), tmp_path / "c")
    (tmp_path / "c" / "critic.json").write_text('{"format": "other", "version": 1}')
    with pytest.raises(ValueError, match="expected 'saorl-critic'"):
        load_critic(tmp_path / "c")
