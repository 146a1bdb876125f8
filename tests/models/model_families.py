"""Small random-init models of the two tokenizer families, built offline and saved to a directory.

- Qwen3 with a byte-level BPE tokenizer (no prefix space, decoding concatenative) and a ChatML
  chat template; eos ``<|im_end|>``, pad ``<|endoftext|>``; no BOS.
- Qwen3-MoE with the same tokenizer (:func:`qwen3_moe_dir`).
- Llama with a SentencePiece-style Unigram tokenizer: the ``▁`` dummy prefix and spaces as ``▁``
  (a ``Prepend`` + ``Replace`` normalizer, as converted Llama 2 / Mistral tokenizers have it),
  byte fallback, BOS ``<s>`` added by the tokenizer, eos ``</s>``, no pad token, no chat template.
  ``sp_tokenizer(metaspace=True)`` is the other SentencePiece layout (a ``Metaspace``
  pre-tokenizer with ``prepend_scheme: first``).

Nothing is downloaded: the tokenizers are trained on a few sentences with the ``tokenizers``
library, the models are built from configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

CORPUS = [
    "Add 12 and 30. The answer is 42.", "<out>5</out> then </answer> and more text",
    "hello world, foo bar baz", "x = 1 + 2\nprint(x)\n", "café → naïve résumé", "  two spaces and\ttab",
] * 40
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (Qwen-style), trained on :data:`CORPUS`, with a ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


def sp_tokenizer(metaspace: bool = False) -> PreTrainedTokenizerFast:
    """SentencePiece-style Unigram with byte fallback and BOS (Llama-style), trained on :data:`CORPUS`."""
    tok = Tokenizer(models.Unigram())
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([
            decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),
            decoders.ByteFallback(), decoders.Fuse()])
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    # every printable ASCII character is a piece: only other characters fall back to bytes
    trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"],
                                      unk_token="<unk>", show_progress=False,
                                      initial_alphabet=[chr(c) for c in range(32, 127)] + ["\n", "\t", "▁"])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    data = json.loads(tok.to_str())  # add the 256 byte pieces, as SentencePiece's byte_fallback has them
    data["model"]["vocab"] += [[f"<0x{i:02X}>", -30.0] for i in range(256)]
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def qwen3_dir(path: Path, seed: int = 0) -> Path:
    """A random-init Qwen3 (hidden 32, 2 layers) + :func:`bpe_tokenizer`, saved to ``path``."""
    tok = bpe_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok) + 16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    return _save(Qwen3ForCausalLM, cfg, tok, path, seed)


def llama_dir(path: Path, seed: int = 0) -> Path:
    """A random-init Llama (hidden 32, 2 layers) + :func:`sp_tokenizer`, saved to ``path``."""
    tok = sp_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    return _save(LlamaForCausalLM, cfg, tok, path, seed)


def qwen3_moe_dir(path: Path, seed: int = 0) -> Path:
    """A random-init Qwen3-MoE (hidden 32, 2 layers, 4 experts, top 2) + :func:`bpe_tokenizer`."""
    tok = bpe_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok) + 16, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return _save(Qwen3MoeForCausalLM, cfg, tok, path, seed)


def _save(cls, cfg, tok, path: Path, seed: int) -> Path:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(cfg)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


# ------------------------------------------------------------------------------ a multi-turn env
from saorl.envs.base import Env, StepResult, Task  # noqa: E402

OBSERVATIONS = ("<out>42</out>\n", " then keep going", "\ncafé → naïve")
"""What :class:`TurnsEnv` answers after turns 1-3: a tag, a leading space (where SentencePiece
would insert a second one), a newline and non-ASCII text. Each starts and ends with a character
of the vocabularies: a random-init model samples byte-fallback pieces, and a SentencePiece decoder
groups byte pieces across a boundary (invalid UTF-8 next to an observation's own byte pieces would
decode to U+FFFD whatever the ids are)."""


class TurnsEnv(Env):
    """Four turns whatever the policy says; records the action texts it received.

    Observations come from :data:`OBSERVATIONS`; reward 1 on the last turn when any action
    mentioned ``42``. ``stop_strings`` end a turn at ``</answer>``.
    """

    name = "turns"
    stop_strings = ("</answer>",)
    max_turns = 4
    seen: ClassVar[list[list[str]]] = []
    """Action texts of every episode played in this process, in episode order (tests read it)."""

    def generate_tasks(self, split, n, seed):
        return [Task(f"{split}-{seed}-{i}", {"a": i, "b": 30}) for i in range(n)]

    def reset(self, task, progress=None):
        self.actions: list[str] = []
        TurnsEnv.seen.append(self.actions)
        return f"Add {task.data['a']} and {task.data['b']}. Answer in <answer></answer>."

    def step(self, action):
        self.actions.append(action)
        turn = len(self.actions)
        if turn > len(OBSERVATIONS):
            ok = any("42" in a for a in self.actions)
            return StepResult("done", float(ok), True, {"success": ok})
        return StepResult(OBSERVATIONS[turn - 1], 0.0, False)

    def demonstration(self, task, rng):
        return ["Let me add.", " <answer>42</answer>", " yes", "42 é</answer>"]
