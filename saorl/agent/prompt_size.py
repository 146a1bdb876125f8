"""What a prompt's size in bytes says about its tokens, without tokenising it.

A prompt so large that even the longest token of the vocabulary could not fit it in a budget is
known to be over it from its size in bytes (a 20 MB row costs nothing) — where that bound
holds: a tokenizer with no normalizer that spells every byte (byte-level BPE, or byte fallback),
as the shipped one, Llama's and Mistral's do; one that normalises text or folds unknown
characters into one token is tokenised whatever the size.
"""

from __future__ import annotations

import json
import weakref

_PER_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer) -> int:
    """The most bytes one token of ``tokenizer``'s vocabulary stands for (its longest entry, in
    UTF-8: an upper bound for byte-level and SentencePiece vocabularies, whose entries spell each
    byte with at least one byte)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    vocab = hf.get_vocab()
    return max((len(t.encode("utf-8")) for t in vocab), default=1)


def bytes_bound_holds(tokenizer) -> bool:
    """Whether a prompt's UTF-8 size over :func:`max_token_bytes` is a lower bound of its tokens
    (module docstring): no normalizer, and every byte spelt (byte-level or byte fallback)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None:
        return False
    return bool((spec.get("model") or {}).get("byte_fallback")) or '"ByteLevel"' in json.dumps(
        spec.get("pre_tokenizer"))


def bytes_per_token(tokenizer) -> int | None:
    """:func:`max_token_bytes` where the bytes bound holds for ``tokenizer``, else None; computed
    once per tokenizer (it reads the whole vocabulary)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    try:
        if hf not in _PER_TOKEN:
            _PER_TOKEN[hf] = max_token_bytes(hf) if bytes_bound_holds(hf) else None
        return _PER_TOKEN[hf]
    except TypeError:  # not weak-referenceable
        return max_token_bytes(hf) if bytes_bound_holds(hf) else None


def prompt_bytes(prompt) -> int:
    """A prompt's size in UTF-8 bytes: its text, or its messages' contents."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(str(m.get("content", "")).encode("utf-8")) for m in prompt if isinstance(m, dict))
