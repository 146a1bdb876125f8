"""Parsing of tagged actions (``<tool>...</tool>``, ``<answer>...</answer>``) shared by the envs.

The format is deliberately rigid so that a tiny model can learn it from a few demonstrations:
an action is exactly one ``<tag>body</tag>`` with only whitespace around it. Engines stop on the
closing tag but may keep a few characters of the last sampled token past it (see
:class:`saorl.engines.base.SamplingParams`), so everything after the first complete closing tag
of an allowed kind is ignored. Anything else is *malformed* and reported with a short reason
that the env can show the model as an observation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedAction:
    tag: str | None
    """The tag name ('tool', 'answer', ...) or None when the action is malformed."""
    body: str
    """Text between the tags, unstripped ('' when malformed)."""
    error: str | None = None
    """Why the action is malformed (short, shown to the model), else None."""


def parse_action(action: str, tags: tuple[str, ...]) -> ParsedAction:
    """Parse ``action`` as exactly one ``<tag>body</tag>`` with ``tag`` in ``tags``.

    Text after the first complete closing tag is dropped (the stop string may end mid-token).
    Text before the opening tag other than whitespace, a missing or mismatched closing tag, a
    nested opening tag, or an unknown tag all make the action malformed.
    """
    if not tags:
        raise ValueError("parse_action needs at least one tag name")
    ends = [(action.find(f"</{t}>"), t) for t in tags]
    ends = [(i, t) for i, t in ends if i >= 0]
    if not ends:
        opened = [t for t in tags if f"<{t}>" in action]
        if opened:
            return ParsedAction(None, "", f"missing </{opened[0]}>")
        names = " or ".join(f"<{t}>...</{t}>" for t in tags)
        return ParsedAction(None, "", f"expected {names}")
    end, tag = min(ends)
    head = action[:end]
    opening = f"<{tag}>"
    start = head.find(opening)
    if start < 0:
        return ParsedAction(None, "", f"</{tag}> without <{tag}>")
    if head[:start].strip():
        return ParsedAction(None, "", f"text before <{tag}>")
    body = head[start + len(opening):]
    for t in tags:
        if f"<{t}>" in body:
            return ParsedAction(None, "", f"<{t}> inside <{tag}>")
    return ParsedAction(tag, body, None)
