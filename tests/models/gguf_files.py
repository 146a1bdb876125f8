"""Tiny GGUF files for the tests, written with the ``gguf`` package's GGUFWriter the way llama.cpp's
``convert_hf_to_gguf.py`` writes a Llama: llama.cpp tensor names, the query/key rows permuted for
its rotary layout, F32 tensors, and the GPT-2 style tokenizer (saorl's shipped byte-level BPE) with
a chat template in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from saorl.models.tokenizer import ASSET_DIR

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_llama(seed: int = 0, tied: bool = True) -> LlamaForCausalLM:
    """A Llama of 2 layers, hidden 32, 4 query / 2 KV heads, on saorl's 1,024-token vocabulary."""
    vocab = json.loads((ASSET_DIR / "tokenizer.json").read_text())
    n_vocab = max(vocab["model"]["vocab"].values()) + 1 + len(vocab["added_tokens"])
    config = LlamaConfig(vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
                         bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: LlamaForCausalLM, path: Path, *, arch: str = "llama", drop: str | None = None,
               merges: list[str] | None = None) -> Path:
    """``model`` as a GGUF file at ``path`` (F32; ``arch`` other than llama makes an unsupported one;
    ``drop``: a prefix of the tensors left out, e.g. ``blk.1.``; ``merges``: the BPE merges written
    instead of the tokenizer's own)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("saorl-tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tok = json.loads((ASSET_DIR / "tokenizer.json").read_text())
    tokens = [""] * c.vocab_size
    types = [gguf.TokenType.NORMAL] * c.vocab_size
    for t, i in tok["model"]["vocab"].items():
        tokens[i] = t
    for added in tok["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], gguf.TokenType.CONTROL
    bpe_merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges if merges is not None else bpe_merges)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            tensors[f"blk.{i}.{gg}.weight"] = t
    for name, t in tensors.items():
        if drop is None or not name.startswith(drop):
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
