"""Observations as chat turns: an env's output rendered through the policy's chat template.

With ``env.observation_format: chat`` the agent loop does not append an observation as text
inside the assistant's message; it ends the assistant's turn and adds the observation as a
message of its own (role ``env.observation_role``: ``tool`` or ``user``), then the header of the
next assistant turn, exactly as the chat template renders that conversation — the format that
chat models trained on tool use with TRL or verl expect (Qwen-style:
``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``).

One episode's :class:`ChatTurns` holds the conversation so far: the prompt (a text prompt is one
user message), then per turn the assistant's action (its text, minus a sampled eos) and the
observation. For each observation it renders

- the *shorter* conversation: the history up to and including the assistant's action, without a
  generation prompt;
- the *longer* one: the history, the observation's message and the generation prompt;

and appends the ids of the template's closing of the assistant's turn followed by
``longer[len(shorter):]`` (the observation's message and the next assistant header). The closing
(``<|im_end|>\\n``) is what the template writes after an assistant's message: told apart once per
episode by rendering the prompt with a probe message (:data:`PROBE_ACTION`), so that the model's
own text is never held against the template (a template that trims a message's spaces still
works; the trajectory keeps the spaces the model sampled). Spaces a template puts between the
generation prompt and the message (Mistral's ``[/INST] ``) are the model's to sample; an action
that starts with them enters the history without them. Earlier ids are never re-tokenized: the
new text is encoded as a continuation of the context
(:meth:`~saorl.models.codec.RunTokenizer.continuation_ids`), exact for byte-level BPE and for
SentencePiece tokenizers, whose dummy prefix would otherwise put a space before it.

The closing after a sampled eos: when the action ended on the eos token and the template's
closing contains the eos text (``<|im_end|>\\n`` after an ``<|im_end|>`` eos), the sampled eos is
that closing's eos, so only what follows it (``\\n``) is added — never a second eos. When the
action ended on a stop string instead (``</tool>``), the whole closing is added. Every appended
token is context: ``action_mask`` 0, so skip-observation GAE and the losses see only the model's
own tokens.

A template that cannot be split this way raises :class:`TemplateSplitError`, one paragraph naming
the problem: the longer rendering does not start with the shorter one, or the rendering with an
assistant's message does not start with the generation prompt followed by that message — a
template that renders a message differently depending on what follows it, such as one that adds
an empty ``<think>`` block to the last assistant message only, or that closes an assistant's turn
differently when a tool message follows. :func:`check_chat_turns` plays a probe episode so that
the run's start-up checks raise it before anything runs.
"""

from __future__ import annotations

from typing import Any

from saorl.models.codec import RunTokenizer

PROBE_PROMPT = "What is 12 + 30?"
PROBE_ACTION = "<answer>42</answer>"
"""The assistant's message that tells the template's closing of a turn apart (no edge spaces, which
some templates trim)."""
PROBE_TURNS = (("<tool>12 + 30</tool>", "<out>42</out>"), ("<answer>42", "<out>ok</out>"))
"""(action, observation) pairs of the start-up probe; the first action ends on eos, the second
does not (as one that ends on a stop string: its closing is added in full)."""

_FIX = ("This happens with a template that renders a message differently depending on what follows "
        "it (one that adds an empty <think> block to the last assistant message only, say). Use a chat "
        "template that renders each message the same wherever it stands in the conversation (set "
        "model.tokenizer to a tokenizer directory whose tokenizer_config.json has one), or set "
        "env.observation_format=text to append observations as text inside the assistant's message")


class TemplateSplitError(ValueError):
    """The chat template cannot add an observation as a turn after the conversation so far."""


def _parting(a: str, b: str) -> str:
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"they part at character {k}: {a[max(0, k - 30):k + 30]!r} versus {b[max(0, k - 30):k + 30]!r}"


class ChatTurns:
    """One episode's conversation, for appending observations as chat turns (module docstring)."""

    def __init__(self, codec: RunTokenizer, prompt: str | list[dict[str, Any]], role: str = "tool") -> None:
        if not codec.applies_chat_template:
            source = codec.spec.source or "the shipped one"
            why = ("model.chat_template is false" if getattr(codec.hf, "chat_template", None)
                   else f"the run's tokenizer ({source}) has none")
            raise TemplateSplitError(
                f"env.observation_format=chat renders observations through the chat template, and {why}. "
                "Use a model whose tokenizer has a chat template (an instruct or chat model), set "
                "model.tokenizer to a tokenizer directory with the same vocabulary whose "
                "tokenizer_config.json has one (and model.chat_template=true), or set "
                "env.observation_format=text")
        self.codec, self.role = codec, role
        self.messages: list[dict[str, Any]] = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt])
        self.rendered = self.prompt_rendered = self._render(self.messages, generation_prompt=True)
        """The template's text of the conversation so far, as the model was last prompted with it."""
        probe = self._render([*self.messages, {"role": "assistant", "content": PROBE_ACTION}],
                             generation_prompt=False)
        at = probe.find(PROBE_ACTION, len(self.prompt_rendered))
        lead = probe[len(self.prompt_rendered):at] if at >= 0 else None
        if not probe.startswith(self.prompt_rendered) or lead is None or lead.strip():
            raise TemplateSplitError(
                "env.observation_format=chat: the chat template cannot add an observation as a turn: "
                "rendered with an assistant's message, the conversation does not start with its rendering "
                "with the generation prompt followed by that message (spaces between them aside) "
                f"({_parting(self.prompt_rendered + PROBE_ACTION, probe)}), so the closing of the "
                f"assistant's turn cannot be told apart. {_FIX}")
        self.lead = lead
        """Spaces the template puts between the generation prompt and an assistant's message (``" "``
        after Mistral's ``[/INST]``): the model samples them itself (SentencePiece's ``▁``), so an
        action that starts with them is its message without them."""
        self.closing = probe[at + len(PROBE_ACTION):]
        """What the template writes after an assistant's message (``<|im_end|>\\n``)."""
        self.exact = True
        """False once an action ended on an eos that the template's closing does not contain: that
        eos stays in the trajectory, so its text differs from the rendering by it."""

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        try:
            return self.codec.hf.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=generation_prompt,
                                                     **self.codec.spec.chat_template_kwargs)
        except Exception as e:
            roles = [m.get("role") for m in messages]
            raise TemplateSplitError(
                f"env.observation_format=chat: the chat template failed on a conversation of roles "
                f"{roles}: {type(e).__name__}: {e}. Some templates refuse a {self.role!r} message or roles "
                f"out of turn: try env.observation_role={'user' if self.role == 'tool' else 'tool'}, or "
                "set env.observation_format=text") from e

    def observation_ids(self, ids: list[int], action: str, observation: str) -> list[int]:
        """The ids to append after ``ids`` (the trajectory so far, ending with the action whose
        text, minus a sampled eos, is ``action``): the closing of the assistant's turn, the
        observation's message and the next assistant header (see the module docstring)."""
        content = action[len(self.lead):] if action.startswith(self.lead) else action
        history = [*self.messages, {"role": "assistant", "content": content}]
        longer_messages = [*history, {"role": self.role, "content": observation}]
        shorter = self._render(history, generation_prompt=False)
        longer = self._render(longer_messages, generation_prompt=True)
        if not longer.startswith(shorter):
            raise TemplateSplitError(
                "env.observation_format=chat: the chat template cannot add an observation as a turn after "
                f"the conversation so far: rendered with a {self.role!r} message and the generation prompt, "
                "the conversation does not start with its rendering up to the assistant's message ("
                f"{_parting(shorter, longer)}), so there are no tokens to append without re-tokenizing the "
                f"past. {_FIX}")
        closing = self.closing
        eos = self.codec.eos_token_id
        if ids and eos is not None and ids[-1] == eos:
            eos_text = self.codec.text([eos])
            cut = closing.find(eos_text) if eos_text else -1
            if cut >= 0:  # the sampled eos is the closing's: add only what follows it
                closing = closing[cut + len(eos_text):]
            else:
                self.exact = False
        new = self.codec.continuation_ids(list(ids), closing + longer[len(shorter):])
        self.messages, self.rendered = longer_messages, longer
        return new


def check_chat_turns(codec: RunTokenizer, role: str) -> None:
    """Play a probe episode of two observations as chat turns; :class:`TemplateSplitError` when the
    template cannot be split, or when the trajectory's text is not the template's rendering of the
    conversation (a template that rewrites earlier messages, a tokenizer that cannot append the
    text exactly)."""
    turns = ChatTurns(codec, PROBE_PROMPT, role)
    ids = codec.prompt_ids(PROBE_PROMPT)
    start = len(ids)
    eos = codec.eos_token_id
    for k, (action, observation) in enumerate(PROBE_TURNS):
        action = turns.lead + action  # as a model trained on the template samples it
        ids += codec.continuation_ids(ids, action)
        if k == 0 and eos is not None:
            ids.append(eos)
        ids += turns.observation_ids(ids, action, observation)
    got = codec.span_text(ids, start, len(ids))
    want = turns.rendered[len(turns.prompt_rendered):]
    if turns.exact and got != want:
        raise TemplateSplitError(
            "env.observation_format=chat: a probe episode's tokens are not the chat template's rendering of "
            f"its conversation: after the prompt they decode to {got!r}, while the template renders "
            f"{want!r} ({_parting(got, want)}). Either the template rewrites earlier messages once more "
            "follow, or the tokenizer cannot encode its text exactly after the context. Use the policy's "
            "own tokenizer and a template that renders each message the same wherever it stands, or set "
            "env.observation_format=text")
