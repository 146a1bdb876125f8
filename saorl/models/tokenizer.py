"""The small byte-level BPE tokenizer that ships with saorl (no model hub needed).

Byte-level with no prefix space and no normalisation, so decoding is concatenative:
``decode(a + b) == decode(a) + decode(b)`` at the byte level. The agent loop relies on this to
append observation tokens without re-tokenizing earlier text. Digits are split one per token
so arithmetic stays learnable for a tiny model.

``python -m saorl.models.tokenizer --out DIR`` rebuilds it from this Python's standard library
sources plus a generated text corpus; the shipped copy under ``assets/tokenizer`` is what
everything loads.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSET_DIR = Path(__file__).parent / "assets" / "tokenizer"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
VOCAB_SIZE = 1024


def _corpus(max_bytes: int = 3_000_000) -> list[str]:
    rng = random.Random(0)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py"))
    rng.shuffle(files)
    texts, total = [], 0
    for p in files:
        t = p.read_text(encoding="utf-8", errors="ignore")
        texts.append(t)
        total += len(t)
        if total > max_bytes:
            break
    words = (
        "the a of to and is in that it for you was with on as have be at one this"
        " sweet love heart young cool wow hey old thee thou doth hath spring moon"
    ).split()
    for _ in range(20000):
        texts.append(" ".join(rng.choice(words) for _ in range(12)) + ".\n")
    return texts


def build(out_dir: Path = ASSET_DIR, vocab_size: int = VOCAB_SIZE) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
        "bos_token": None, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a directory means it holds a tokenizer."""


def load_tokenizer(path: str | Path | None = None, what: str = "model.tokenizer"):
    """An HF tokenizer: the shipped one by default, or the one of a local directory or Hub model id.

    ``what`` names the config field in errors. The run's tokenizer (the policy's own by default,
    with its prompt format) is :func:`saorl.models.codec.run_tokenizer`.
    """
    from transformers import AutoTokenizer

    from saorl.models.source import LOCAL_KINDS, parse

    source = ASSET_DIR if path is None else parse(str(path), what, LOCAL_KINDS).resolve().local
    if not any((source / name).is_file() for name in TOKENIZER_FILES):
        field = "--tokenizer" if what.startswith("--") else "model.tokenizer"  # serve: the flag
        raise FileNotFoundError(
            f"{what} {str(path)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); set "
            f"{field} to the directory (or Hub id) of the tokenizer the policy was trained with")
    return AutoTokenizer.from_pretrained(str(source), local_files_only=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ASSET_DIR)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    a = ap.parse_args()
    print(build(a.out, a.vocab_size))
