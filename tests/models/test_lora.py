"""LoRA policies on the tiny models: targets, the peft-free merge the engine uses, and the exports
(a merged model plain transformers loads, and an adapter directory on its named base)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")

from saorl.config.sections import LORA_TARGETS
from saorl.models.adapter import AdapterMerger, adapter_deltas, read_adapter, write_adapter_dir
from saorl.models.logprobs import token_logprobs
from saorl.models.lora import (
    adapter_config,
    adapter_state,
    attach_lora,
    linear_names,
    load_adapter_policy,
    merged_copy,
    resolve_targets,
    save_adapter,
)
from saorl.models.serialize import export_policy
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer

IDS = torch.tensor([[5, 17, 230, 41, 99, 3, 64, 812, 7, 15, 400, 22]])


def _lora(kind="tiny-dense", seed=0, b_std=0.05, targets=LORA_TARGETS):
    model = attach_lora(build_tiny(kind, seed=seed), rank=4, alpha=8.0, dropout=0.0, targets=list(targets),
                        optional=LORA_TARGETS, base={"policy": kind, "seed": seed})
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        gen = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    return model.eval()


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, IDS, torch.ones_like(IDS))


def test_a_fresh_adapter_is_exactly_the_base_and_the_defaults_fit_dense_and_moe():
    for kind, targeted in (("tiny-dense", set(LORA_TARGETS)), ("tiny-moe", {"q_proj", "k_proj", "v_proj",
                                                                             "o_proj"})):
        fresh = _lora(kind, b_std=0.0)
        assert torch.equal(_logprobs(fresh), _logprobs(build_tiny(kind)))
        adapted = {n.split(".lora_A.")[0].rpartition(".")[2] for n, _ in fresh.named_parameters()
                   if ".lora_A." in n}
        assert adapted == targeted


def test_an_unknown_target_is_one_paragraph_naming_the_models_linear_modules():
    moe = build_tiny("tiny-moe")
    assert linear_names(moe) == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
    with pytest.raises(ValueError) as e:
        resolve_targets(moe, ["q_proj", "qkv_proj"], LORA_TARGETS)
    assert str(e.value) == ("model.lora.target_modules: qkv_proj names no nn.Linear module of the policy "
                            "(Qwen3MoeForCausalLM), whose linear modules are named k_proj, lm_head, o_proj, "
                            "q_proj, v_proj; list some of those")
    with pytest.raises(ValueError, match="none of gate_proj, up_proj is a linear module"):
        resolve_targets(moe, ["gate_proj", "up_proj"], LORA_TARGETS)


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_the_engines_merge_equals_peft_and_follows_each_adapter_from_the_base(kind, tmp_path):
    plain = build_tiny(kind)
    merger = AdapterMerger()
    for seed, targets in ((0, LORA_TARGETS), (1, ("q_proj", "v_proj"))):
        lora = _lora(kind, seed=0, targets=targets) if seed == 0 else _lora(kind, seed=0, targets=targets,
                                                                              b_std=0.2)
        path = write_adapter_dir(adapter_state(lora), adapter_config(lora), tmp_path / f"a{seed}")
        new = merger.merged(plain, path)
        with torch.no_grad():
            for name, t in new.items():
                plain.state_dict()[name].copy_(t)
        # the second adapter targets fewer modules: the others went back to the base
        assert (_logprobs(plain) - _logprobs(lora)).abs().max() < 1e-5
        assert (_logprobs(plain) - _logprobs(merged_copy(lora))).abs().max() < 1e-5
    base = build_tiny(kind).state_dict()
    assert torch.equal(plain.state_dict()["model.layers.0.self_attn.o_proj.weight"],
                       base["model.layers.0.self_attn.o_proj.weight"])


def test_the_merged_weights_are_computed_as_read_and_equal_the_eager_sum_bit_for_bit(tmp_path):
    """AdapterMerger.merged gives a mapping that computes each weight when it is read (an engine
    applies them one at a time): each equals base + s·B·A summed in float32 exactly, its shape is
    known without computing it, and a weight the previous adapter targeted and this one does not
    reads as its base."""
    plain = build_tiny("tiny-dense")
    base = {k: v.clone() for k, v in plain.state_dict().items()}
    merger = AdapterMerger()
    first = write_adapter_dir(adapter_state(_lora()), adapter_config(_lora()), tmp_path / "a")
    lora = _lora(targets=("q_proj",), b_std=0.2)
    second = write_adapter_dir(adapter_state(lora), adapter_config(lora), tmp_path / "b")
    assert merger.merged(plain, first)  # the base of every default target is kept now
    merged = merger.merged(plain, second)
    config, tensors = read_adapter(second)
    deltas = adapter_deltas(config, tensors)
    assert set(deltas) < set(merged) and len(merged) == len(list(merged))
    for name in merged:
        assert merged.shape(name) == tuple(base[name].shape)
        want = (base[name].float() + deltas[name]).to(base[name].dtype) if name in deltas else base[name]
        assert torch.equal(merged[name], want), name
    assert any(name not in deltas for name in merged)  # the first adapter's other targets: the base
    q = "model.layers.0.self_attn.q_proj.weight"
    assert merged[q] is not merged[q]  # made as read, not held


def test_an_adapter_that_is_not_plain_lora_is_refused(tmp_path):
    lora = _lora()
    config, tensors = adapter_config(lora), adapter_state(lora)
    with pytest.raises(ValueError, match="use_dora=True; only plain LoRA adapters can be merged"):
        adapter_deltas({**config, "use_dora": True}, tensors)
    path = write_adapter_dir(tensors, config, tmp_path / "a")
    assert read_adapter(path)[0]["r"] == 4
    with pytest.raises(ValueError, match="targets weights the model does not have"):
        AdapterMerger().merged(torch.nn.Linear(2, 2), path)


def test_the_merged_export_loads_in_plain_transformers_and_the_adapter_on_its_base(tmp_path):
    lora = _lora("tiny-moe", seed=3)
    expected = _logprobs(lora)
    export_policy(merged_copy(lora), load_tokenizer(), tmp_path / "policy")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"), local_files_only=True).eval()
    assert type(plain).__name__ == "Qwen3MoeForCausalLM"
    assert (_logprobs(plain) - expected).abs().max() < 1e-5
    save_adapter(lora, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "saorl_base.json").read_text()) == {"policy": "tiny-moe",
                                                                                 "seed": 3}
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    rebuilt = load_adapter_policy(tmp_path / "adapter")
    assert not hasattr(rebuilt, "peft_config")
    assert (_logprobs(rebuilt) - expected).abs().max() < 1e-5
    # the LoRA model itself is untouched by the merged copies
    assert torch.equal(_logprobs(lora), expected)
    (tmp_path / "adapter" / "saorl_base.json").write_text(json.dumps({"policy": str(tmp_path / "gone")}))
    with pytest.raises(FileNotFoundError, match=r"sits on the base '.*gone' \(named in its saorl_base"):
        load_adapter_policy(tmp_path / "adapter")


def test_on_a_llama_model_the_defaults_take_attention_and_mlp_and_the_merge_matches(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False)).eval()
    plain = LlamaForCausalLM(llama.config).eval()
    plain.load_state_dict(llama.state_dict())
    lora = attach_lora(llama, rank=4, alpha=8.0, dropout=0.0, targets=list(LORA_TARGETS),
                       optional=LORA_TARGETS)
    adapted = {n.split(".lora_A.")[0].rpartition(".")[2] for n, _ in lora.named_parameters()
               if ".lora_A." in n}
    assert adapted == set(LORA_TARGETS)  # lm_head is a linear module too, but not a default target
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    path = write_adapter_dir(adapter_state(lora), adapter_config(lora), tmp_path / "a")
    with torch.no_grad():
        for name, t in AdapterMerger().merged(plain, path).items():
            plain.state_dict()[name].copy_(t)
    assert (_logprobs(plain) - _logprobs(lora)).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_a_lora_critic_starts_as_its_base_and_saves_merged_into_the_plain_layout(kind, tmp_path):
    from saorl.models.critic import Critic
    from saorl.models.lora import attach_critic_lora
    from saorl.models.serialize import load_critic, save_critic

    critic = Critic.from_policy(build_tiny(kind, seed=0))
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        before = critic(IDS, mask)
    attach_critic_lora(critic, rank=4, alpha=8.0, dropout=0.0, targets=list(LORA_TARGETS),
                       optional=LORA_TARGETS)
    with torch.no_grad():
        assert torch.equal(critic(IDS, mask), before)  # B = 0
        for n, p in critic.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
        trained = critic(IDS, mask)
    assert (trained - before).abs().max() > 1e-3
    save_critic(critic, tmp_path / "critic")
    loaded = load_critic(tmp_path / "critic")
    assert not loaded.lora and not any("lora_" in n for n, _ in loaded.named_parameters())
    with torch.no_grad():
        assert (loaded(IDS, mask) - trained).abs().max() < 1e-5
    assert critic.lora  # the critic saved keeps its adapter
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        attach_critic_lora(critic, rank=4, alpha=8.0, dropout=0.0, targets=["q_proj"])
