import json

import pytest
import torch

from saorl.models.loading import load_policy
from saorl.models.serialize import export_policy
from saorl.models.tokenizer import load_tokenizer

H, V, L, KV, HEAD = 128, 1024, 4, 2, 32


def _attention_and_norms() -> int:
    q, kv = 4 * HEAD * H, KV * HEAD * H
    return q + 2 * kv + q + 2 * HEAD + 2 * H  # q, k, v, o, q/k norm, two layer norms


def test_tiny_parameter_counts():
    moe = 8 * (2 * 128) * H + 8 * H * 128 + 8 * H  # fused gate_up, down, router
    dense = 3 * 384 * H
    embed_and_final_norm = V * H + H  # lm_head is tied to the embedding
    expected = {
        "tiny-moe": L * (_attention_and_norms() + moe) + embed_and_final_norm,
        "tiny-dense": L * (_attention_and_norms() + dense) + embed_and_final_norm,
    }
    assert expected == {"tiny-moe": 1_906_048, "tiny-dense": 918_912}
    for kind, n in expected.items():
        model = load_policy(kind)
        assert sum(p.numel() for p in model.parameters()) == n
        assert not model.training
    assert load_policy("tiny-moe").config._experts_implementation == "grouped_mm"


def test_seed_and_dtype():
    a, b, c = load_policy("tiny-dense", seed=1), load_policy("tiny-dense", seed=1), load_policy("tiny-dense")
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    bf = load_policy("tiny-dense", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_policy("tiny-dense", dtype="float8")


def test_missing_or_empty_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_policy(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_policy(str(tmp_path))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        load_policy(str(f))


def test_local_dir_loads_with_grouped_mm_even_if_config_says_eager(tmp_path):
    model = load_policy("tiny-moe", seed=3)
    out = export_policy(model, load_tokenizer(), tmp_path / "pol")
    cfg = json.loads((out / "config.json").read_text())
    cfg["experts_implementation"] = "eager"
    (out / "config.json").write_text(json.dumps(cfg))
    loaded = load_policy(str(out))
    assert loaded.config._experts_implementation == "grouped_mm"
    x = torch.randint(2, V, (2, 6))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, loaded(x).logits, atol=1e-6)


def test_float16_runs_train_in_float32():
    """float16 is a GPU setting (a config error on CPU); its trainers hold float32 weights."""
    from saorl.config import load_config
    from saorl.models.critic import Critic
    from saorl.models.loading import train_dtype

    cfg = load_config(None, ["model.dtype=float16", "model.device=cuda"])  # validates without a GPU
    assert train_dtype(cfg.model.dtype) == "float32"
    assert train_dtype("bfloat16") == "bfloat16" and train_dtype("float32") == "float32"
    sampler = load_policy("tiny-dense", dtype="float16")
    assert next(sampler.parameters()).dtype == torch.float16
    critic = Critic.from_policy(sampler, dtype=train_dtype("float16"))  # as value pretraining builds it
    assert {p.dtype for p in critic.trunk.parameters()} == {torch.float32}
