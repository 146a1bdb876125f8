"""Text ↔ token ids for the agent loop: the run's tokenizer, its prompt format, exact continuations.

The agent loop builds a trajectory by appending ids and never re-tokenizes earlier text: the
prompt's ids, then each turn's sampled ids as the engine returned them, then each observation's
ids. Three operations make that exact for byte-level BPE tokenizers (Qwen, GPT-2, Llama 3 style)
and for SentencePiece-style ones (Llama 2, Mistral: a ``▁`` dummy prefix, space as ``▁``):

- :meth:`RunTokenizer.prompt_ids`: with the tokenizer's chat template (when it has one and the
  run allows it) a text prompt is one user message plus the generation prompt, rendered as text and
  encoded without adding special tokens (the template writes its own BOS). Without one: the
  special tokens the tokenizer itself puts before a text (BOS for Llama-style tokenizers, nothing
  for Qwen-style ones), then the text; an EOS the tokenizer appends is not kept. A prompt that is
  a conversation (a list of ``{"role", "content"}`` messages, system message included, as TRL's
  conversational datasets hold them) is rendered by the chat template as it is, plus the generation
  prompt; without a template (or with ``model.chat_template=false``) it is an error saying so.
- :meth:`RunTokenizer.continuation_ids` (observations): ids that, appended to the context,
  decode to the context's text followed by exactly the observation. For byte-level BPE that is
  ``encode(text)``. For SentencePiece ``encode(text)`` starts with the dummy prefix and would
  insert a space (``"</answer> <out>"``); the same tokenizer with the prefix turned off
  (:func:`without_prefix_space`) encodes it instead. Each candidate is checked by decoding; if
  none passes (an exotic tokenizer) the plain encoding is used and a warning says so once.
- :meth:`RunTokenizer.span_text` (actions, rendering): the text ``ids[start:end]`` adds after
  ``ids[:start]``, i.e. ``decode(ids[c:end])`` minus ``decode(ids[c:start])`` with ``c`` a few
  tokens before ``start``. Decoding a span alone is wrong for SentencePiece: the decoder drops the
  leading space of the first token, so an action sampled as ``"▁foo"`` would read ``"foo"``.

So ``decode(traj.token_ids)`` is the decoded prompt followed by every action's text and every
observation, exactly. Observations continue the assistant's message as plain text (tool output
inline, the format of the built-in multi-turn envs) unless the env's observation format is
``chat``: then :mod:`saorl.models.chat_turns` wraps each as a chat turn of its own, through the
template, with the same continuation encoding.

:class:`RunTokenizer` is the HF tokenizer plus the run's prompt format: every other attribute is
the HF tokenizer's (``decode``, ``eos_token_id``, ``save_pretrained``, ...), so engines, the
recorder and exports take it where they took the HF tokenizer. :func:`run_tokenizer` is the one
place that decides a run's tokenizer (``model.tokenizer``, else the policy's own, else the shipped
one for tiny kinds); every stage calls it, and :func:`check_vocab` refuses a tokenizer whose ids
do not fit the model.
"""

from __future__ import annotations

import json
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONTEXT_TOKENS = 16
"""Tokens of context decoded before a span or a continuation to check it (a character is at most
4 bytes, so a few tokens re-synchronise any decoder)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What identifies a run's tokenizer (picklable: rollout workers load theirs from it)."""

    source: str | None
    """Local tokenizer directory; None: the shipped tokenizer."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to prompts when it has one."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (e.g. ``enable_thinking``)."""

    def load(self) -> RunTokenizer:
        from saorl.models.tokenizer import load_tokenizer

        return RunTokenizer(load_tokenizer(self.source), self)


class RunTokenizer:
    """An HF tokenizer plus the run's prompt format (see the module docstring)."""

    def __init__(self, hf: Any, spec: TokenizerSpec | None = None) -> None:
        self.hf = hf
        self.spec = spec or TokenizerSpec(None)
        self._no_prefix: Any = None
        self._warned = False

    def __getattr__(self, name: str) -> Any:
        if name in ("hf", "spec") or name.startswith("__"):  # not set yet (unpickling, copy)
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.hf)

    def __repr__(self) -> str:
        return f"RunTokenizer({self.spec!r}, {type(self.hf).__name__}, {len(self.hf)} tokens)"

    @property
    def pad_token_id(self) -> int:
        """The padding id of batches: the tokenizer's, else its eos, else 0. Padding is masked out
        everywhere, so any id inside the vocabulary serves (Llama-style tokenizers define none)."""
        for tid in (self.hf.pad_token_id, self.hf.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0

    # ------------------------------------------------------------------------------ text
    @property
    def applies_chat_template(self) -> bool:
        return self.spec.chat_template and bool(getattr(self.hf, "chat_template", None))

    def text(self, ids: list[int]) -> str:
        """The decoded text of ``ids``: every token's text, special tokens included, no clean-up of
        spaces (``decode`` itself is the HF tokenizer's)."""
        return self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def ids(self, text: str) -> list[int]:
        """``text``'s ids with no special tokens added (``encode`` itself is the HF tokenizer's)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def prompt_ids(self, text: str | list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's ids: chat template, or the tokenizer's own leading special tokens + text; a
        conversation (a list of messages) through the chat template only, with ``tools`` (OpenAI
        function schemas) passed to the template when given."""
        if isinstance(text, list):
            return self._conversation_ids(text, tools)
        if self.applies_chat_template:
            try:
                rendered = self.hf.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                    **self.spec.chat_template_kwargs)
            except Exception as e:
                raise ValueError(
                    f"the tokenizer's chat template failed on a one-message conversation: "
                    f"{type(e).__name__}: {e}; set model.chat_template=false to encode prompts as they are"
                ) from e
            return self.ids(rendered)
        plain = self.ids(text)
        full = list(self.hf.encode(text, add_special_tokens=True))
        n = len(plain)
        for k in range(len(full) - n + 1):  # keep what comes before the text (BOS), drop what follows
            if full[k:k + n] == plain:
                return full[:k + n]
        return full

    def _conversation_ids(self, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.applies_chat_template:
            start = ("the prompt is a conversation (a list of chat messages), which only a chat template can "
                     "turn into tokens, and ")
            if getattr(self.hf, "chat_template", None):
                raise ValueError(start + "model.chat_template is false: set model.chat_template=true (the "
                                 "tokenizer has one), or give the prompts as text")
            raise ValueError(
                start + f"the run's tokenizer ({self.spec.source or 'the shipped one'}) has none. Use a "
                "model whose tokenizer has one (an instruct or chat model), or set model.tokenizer to a "
                "tokenizer directory with the same vocabulary whose tokenizer_config.json has a "
                "chat_template, or give the prompts as text")
        roles = [m.get("role") for m in messages]
        try:
            extra = {} if tools is None else {"tools": tools}
            rendered = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                   **extra, **self.spec.chat_template_kwargs)
        except Exception as e:
            raise ValueError(f"the tokenizer's chat template failed on a conversation of roles {roles}: "
                             f"{type(e).__name__}: {e} (some templates refuse a system message, or roles "
                             "out of turn)") from e
        return self.ids(rendered)

    def continuation_ids(self, context: list[int], text: str) -> list[int]:
        """Ids that append exactly ``text`` to the decoded ``context`` (see the module docstring)."""
        if not text:
            return []
        tail = list(context[-CONTEXT_TOKENS:])
        before = self.text(tail)
        plain = self.ids(text)
        if self.text(tail + plain) == before + text:
            return plain
        variant = self._without_prefix()
        if variant is not None:
            ids = variant.encode(text, add_special_tokens=False).ids
            if self.text(tail + ids) == before + text:
                return ids
        if not self._warned:
            self._warned = True
            warnings.warn(f"{type(self.hf).__name__}: found no token ids that append {text[:40]!r} exactly "
                          "after the context; using its plain encoding (decoded trajectories may differ "
                          "from the texts the env saw by a space)", stacklevel=2)
        return plain

    def span_text(self, ids: list[int], start: int, end: int) -> str:
        """The text ``ids[start:end]`` adds after ``ids[:start]`` (see the module docstring)."""
        if start <= 0:
            return self.text(ids[:end])
        for lo in (max(0, start - CONTEXT_TOKENS), 0):
            head, full = self.text(ids[lo:start]), self.text(ids[lo:end])
            if full.startswith(head):
                return full[len(head):]
        return self.text(ids[start:end])  # a decoder that rewrites its past: no exact answer

    def _without_prefix(self) -> Any:
        if self._no_prefix is None:
            backend = getattr(self.hf, "backend_tokenizer", None)
            self._no_prefix = (backend and without_prefix_space(backend)) or False
        return self._no_prefix or None


def without_prefix_space(backend: Any) -> Any | None:
    """A copy of a ``tokenizers.Tokenizer`` that adds no dummy prefix (``▁`` or a space) before a
    text, or None when it adds none: ``Prepend`` normalizers removed, ``Metaspace`` pre-tokenizers
    set to ``prepend_scheme: never``, ``ByteLevel`` ones to ``add_prefix_space: false``."""
    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    changed = [False]

    def strip_normalizer(n: dict | None) -> dict | None:
        if n is None:
            return None
        if n.get("type") == "Prepend":
            changed[0] = True
            return None
        if n.get("type") == "Sequence":
            n["normalizers"] = [m for m in map(strip_normalizer, n["normalizers"]) if m is not None]
        return n

    def no_prefix(p: dict | None) -> None:
        if p is None:
            return
        if p.get("type") == "Metaspace" and (p.get("prepend_scheme", "always") != "never"
                                             or p.get("add_prefix_space")):
            p["prepend_scheme"], changed[0] = "never", True
            if "add_prefix_space" in p:
                p["add_prefix_space"] = False
        if p.get("type") == "ByteLevel" and p.get("add_prefix_space"):
            p["add_prefix_space"], changed[0] = False, True
        for child in p.get("pretokenizers", []):
            no_prefix(child)

    data["normalizer"] = strip_normalizer(data.get("normalizer"))
    no_prefix(data.get("pre_tokenizer"))
    return Tokenizer.from_str(json.dumps(data)) if changed[0] else None


_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def as_run_tokenizer(tokenizer: Any) -> RunTokenizer:
    """``tokenizer`` if it is a :class:`RunTokenizer`; an HF tokenizer wrapped with the default
    prompt format (chat template when it has one), one wrapper per tokenizer object."""
    if isinstance(tokenizer, RunTokenizer):
        return tokenizer
    try:
        wrapped = _WRAPPED.get(tokenizer)
        if wrapped is None:
            wrapped = _WRAPPED[tokenizer] = RunTokenizer(tokenizer)
        return wrapped
    except TypeError:  # not weak-referenceable: a fresh wrapper
        return RunTokenizer(tokenizer)


# ---------------------------------------------------------------------------- the run's tokenizer
def tokenizer_source(policy: str, tokenizer: str | None) -> str | None:
    """Where a run's tokenizer comes from: ``tokenizer`` when set; else the policy's own (its
    directory or Hub id); None (the shipped tokenizer) for a tiny kind."""
    from saorl.models.source import is_tiny

    if tokenizer:
        return tokenizer
    return None if is_tiny(policy) else policy


def tokenizer_spec(model: Any) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of a ``model`` config section (a Hub id resolved to its local
    snapshot, so workers never ask the Hub)."""
    from saorl.models.source import LOCAL_KINDS, parse

    source = tokenizer_source(model.policy, model.tokenizer)
    what = "model.tokenizer" if model.tokenizer else "model.policy"
    local = None if source is None else str(parse(source, what, LOCAL_KINDS).resolve().local)
    return TokenizerSpec(local, model.chat_template, dict(model.chat_template_kwargs))


def prompt_format_key(model: Any) -> dict[str, Any]:
    """The prompt format's part of a cache key (SFT, value pretraining) for a ``model`` config
    section: empty for the defaults, so keys made before the format existed stay valid."""
    fmt: dict[str, Any] = {}
    if not model.chat_template:
        fmt["chat_template"] = False
    if model.chat_template_kwargs:
        fmt["chat_template_kwargs"] = dict(model.chat_template_kwargs)
    return {"prompt_format": fmt} if fmt else {}


def run_tokenizer(model: Any) -> RunTokenizer:
    """The tokenizer of the run whose ``model`` config section is given: what every stage uses.

    An explicit ``model.tokenizer`` whose vocabulary differs from the tokenizer stored with the
    policy is an error (the policy would read the wrong ids).
    """
    spec = tokenizer_spec(model)
    tok = spec.load()
    if model.tokenizer and tokenizer_source(model.policy, None) is not None:
        _check_same_vocab(tok, model.policy, model.tokenizer)
    return tok


def _check_same_vocab(tok: RunTokenizer, policy: str, tokenizer: str) -> None:
    from saorl.models.source import parse
    from saorl.models.tokenizer import TOKENIZER_FILES, load_tokenizer

    policy_dir = parse(policy).resolve().local
    if Path(policy_dir).resolve() == Path(tok.spec.source or "").resolve():
        return
    if not any((policy_dir / name).is_file() for name in TOKENIZER_FILES):
        return  # the policy came without a tokenizer: model.tokenizer is the only one
    own = load_tokenizer(policy_dir, "model.policy")
    if own.get_vocab() != tok.hf.get_vocab():
        raise ValueError(
            f"model.tokenizer {tokenizer!r} ({len(tok)} tokens) has a different vocabulary from the "
            f"tokenizer stored with the policy {policy!r} ({len(own)} tokens): the policy would read the "
            "wrong ids. Leave model.tokenizer unset to use the policy's own tokenizer")


def check_vocab(tokenizer: Any, model: Any, what: str = "policy") -> None:
    """Raise unless every id of ``tokenizer`` indexes a row of ``model``'s input embedding."""
    rows = model.get_input_embeddings().num_embeddings
    hf = tokenizer.hf if isinstance(tokenizer, RunTokenizer) else tokenizer
    top = max(hf.get_vocab().values(), default=-1) + 1
    if top > rows:
        raise ValueError(
            f"the tokenizer ({len(hf)} tokens, ids up to {top - 1}) does not fit the {what} "
            f"({type(model).__name__}, an embedding of {rows} rows): ids ≥ {rows} would crash the "
            "embedding lookup, and a tokenizer that is not the model's own feeds it the wrong ids. Leave "
            "model.tokenizer unset to use the policy directory's own tokenizer (tiny kinds use the "
            "shipped one), or set it to the tokenizer the policy was trained with")
