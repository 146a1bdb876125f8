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
from saorl.models.tiny import build_tiny
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


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_published_weights_carry_the_tied_head_and_load_back(tmp_path, kind):
    """An inference server keeps its own copy of a tied output head and reloads only what the
    checkpoint carries, so a publication writes ``lm_head.weight`` too (not what save_pretrained
    writes); ``from_pretrained`` takes the directory back, head still tied, every tensor equal."""
    from safetensors.torch import load_file

    from saorl.models import hf_format
    from saorl.models.hf_format import saved_names, served_names

    model = build_tiny(kind, seed=4)
    assert "lm_head.weight" not in saved_names(model) and "lm_head.weight" in served_names(model)
    out = hf_format.save_hf_weights(model, model.state_dict(), tmp_path / "v1")
    names = set(load_file(str(out / "model.safetensors")))
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    back = load_policy(str(out))
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(KeyError, match="lacks 1 of the model's weights"):
        hf_format.save_hf_weights(model, {k: v for k, v in model.state_dict().items()
                                          if k != "model.norm.weight"}, tmp_path / "v2")
    assert not (tmp_path / "v2").exists()


def test_an_untied_head_is_published_once(tmp_path):
    from safetensors.torch import load_file

    from saorl.models import hf_format
    from saorl.models.hf_format import saved_names, served_names

    model = build_tiny("tiny-dense", seed=1, tie_word_embeddings=False)
    assert served_names(model) == saved_names(model)
    out = hf_format.save_hf_weights(model, model.state_dict(), tmp_path / "v1")
    back = load_policy(str(out))
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(back.lm_head.weight, back.model.embed_tokens.weight)
    assert len(load_file(str(out / "model.safetensors"))) == len(model.state_dict())
