"""Cutting a prompt to a token limit, keeping its end (``env.overlong_prompts: truncate``).

Which side is kept: the end. A prompt's end is what the reply answers — the question after a
long context, the latest turns of a conversation — and the chat template's generation prompt
comes last; a prompt cut from its end would lose exactly those and ask the model to continue
mid-document.

How, token-exactly: the cut is made in the prompt's *content*, never in its rendered ids, and
the cut prompt is rendered again by :meth:`~saorl.models.codec.RunTokenizer.prompt_ids`; so the
template's header and footer (BOS, role markers, the generation prompt) survive whole, and the
ids the model sees are exactly the cut prompt's rendering, ``limit`` tokens or fewer.

- A text prompt: the text is cut at its start, at a token boundary of its own tokenisation, to
  the longest end whose rendered prompt fits.
- A prompt of chat messages: the leading system messages are kept whole; the earliest other
  content goes first. Whole rounds (a message with the role the conversation opens with, and
  the messages up to the next one of that role) are dropped from the front while the cut would
  have to go past a round's first message, so the conversation still opens with the role it
  opened with (templates that insist on user/assistant alternation accept it); then the first
  remaining message's content is cut at its start (in the last round only, a message whose
  content is used up is kept empty, and the cut goes on into the next).
- A prompt whose uncuttable part — the template's own tokens, the system messages, the last
  message's header — is alone over the limit cannot be cut to fit: :func:`cut_prompt` returns None.

A huge text is not tokenised whole: where the bytes bound of :mod:`saorl.agent.prompt_size` holds,
only its last ``limit × (the longest token's bytes)`` characters can be part of the kept end, and
only those are tokenised. The search renders the prompt a handful of times (a guess from the
token count, then galloping and bisection), each time about ``limit`` tokens long.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from saorl.agent.prompt_size import bytes_per_token, prompt_bytes

Prompt = str | list[dict[str, Any]]


def fitted_prompt(tokenizer, prompt: Prompt, limit: int) -> tuple[Prompt, list[int]] | None:
    """``(prompt, its ids)`` (:meth:`~saorl.models.codec.RunTokenizer.prompt_ids`) if they are
    ``limit`` or fewer, else the prompt cut to fit and its ids (:func:`cut_prompt`); None if it
    cannot be."""
    per_token = bytes_per_token(tokenizer)
    if per_token is None or prompt_bytes(prompt) <= limit * per_token:  # else over by its bytes alone
        ids = tokenizer.prompt_ids(prompt)
        if len(ids) <= limit:
            return prompt, ids
    return cut_prompt(tokenizer, prompt, limit)


def fitted_prompt_ids(tokenizer, prompt: Prompt, limit: int) -> list[int] | None:
    """The ids of :func:`fitted_prompt` (None if the prompt cannot be cut to ``limit``)."""
    fitted = fitted_prompt(tokenizer, prompt, limit)
    return None if fitted is None else fitted[1]


def cut_prompt(tokenizer, prompt: Prompt, limit: int) -> tuple[Prompt, list[int]] | None:
    """``prompt`` cut to ``limit`` tokens or fewer keeping its end, and its ids; None where its
    uncuttable part alone is over the limit (module docstring). ``tokenizer`` is the run's
    :class:`~saorl.models.codec.RunTokenizer`."""
    if isinstance(prompt, str):
        kept = _longest_end(tokenizer, prompt, lambda text: tokenizer.prompt_ids(text), limit)
        return None if kept is None else (kept, tokenizer.prompt_ids(kept))
    return _cut_messages(tokenizer, prompt, limit)


def can_cut(tokenizer, prompt: Prompt, limit: int) -> bool:
    """Whether :func:`cut_prompt` finds a cut of ``prompt`` within ``limit`` tokens, from one
    rendering of its uncuttable part (the template with no text; the system messages and the last
    round, emptied)."""
    if isinstance(prompt, str):
        return len(tokenizer.prompt_ids("")) <= limit
    system, rest = _split_system(prompt)
    if not rest:
        return False
    opener = rest[0].get("role")
    last = max(i for i, m in enumerate(rest) if m.get("role") == opener or i == 0)
    return len(tokenizer.prompt_ids(system + [{**m, "content": ""} for m in rest[last:]])) <= limit


def _split_system(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The leading system messages, and the rest."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return list(messages[:n]), list(messages[n:])


def _cut_messages(tokenizer, messages: list[dict[str, Any]], limit: int):
    system, rest = _split_system(messages)
    if not rest:
        return None

    def ids_of(msgs: list[dict[str, Any]]) -> list[int]:
        return tokenizer.prompt_ids(system + msgs)

    opener = rest[0].get("role")
    while True:  # drop the first round while the cut would have to go past its first message
        starts = [i for i, m in enumerate(rest) if m.get("role") == opener and i > 0]
        if not starts or len(ids_of([{**rest[0], "content": ""}, *rest[1:]])) <= limit:
            break
        rest = rest[starts[0]:]
    for j, message in enumerate(rest):  # then the earliest content, message by message
        head, tail = rest[:j], rest[j + 1:]

        def with_content(text: str, head=head, tail=tail, message=message) -> list[dict[str, Any]]:
            return [*head, {**message, "content": text}, *tail]

        content = str(message.get("content", ""))
        kept = _longest_end(tokenizer, content, lambda text, f=with_content: ids_of(f(text)), limit)
        if kept is not None:
            cut = system + with_content(kept)
            return cut, tokenizer.prompt_ids(cut)
        rest = with_content("")
    return None


def _longest_end(tokenizer, text: str, ids_of: Callable[[str], list[int]], limit: int) -> str | None:
    """The longest end of ``text`` (cut at a token boundary) whose ``ids_of`` are ``limit`` or
    fewer; None when even the empty text's are over."""
    per_token = bytes_per_token(tokenizer)
    over_by_bytes = per_token is not None and prompt_bytes(text) > limit * per_token
    if not over_by_bytes and len(ids_of(text)) <= limit:
        return text
    if len(ids_of("")) > limit:
        return None
    base = 0 if per_token is None else max(0, len(text) - limit * per_token)
    starts = _token_starts(tokenizer, text[base:])
    starts = [base + s for s in starts if base + s > 0] + [len(text)]  # candidate cuts, ascending

    def fits(k: int) -> bool:
        return len(ids_of(text[starts[k]:])) <= limit

    overhead = len(ids_of(""))
    guess = min(len(starts) - 1, max(0, len(starts) - (limit - overhead)))
    # the answer: the smallest k that fits (the last one, the empty end, always does)
    if fits(guess):
        hi, step, lo = guess, 1, guess - 1
        while lo >= 0 and fits(lo):
            hi, lo, step = lo, lo - step, step * 2
        lo = max(lo, -1)
    else:
        lo, step, hi = guess, 1, min(guess + 1, len(starts) - 1)
        while not fits(hi):
            lo, hi, step = hi, min(hi + step, len(starts) - 1), step * 2
    while hi - lo > 1:  # lo does not fit (or is -1), hi does
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return text[starts[hi]:]


def _token_starts(tokenizer, text: str) -> list[int]:
    """The character offsets where ``text``'s tokens start (every character's, for a tokenizer
    that reports no offsets)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    try:
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        return list(range(len(text)))
    return sorted({int(s) for s, e in offsets if e > s})
