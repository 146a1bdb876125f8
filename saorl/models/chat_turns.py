"""Observations as chat turns: an env's output rendered through the policy's chat template.

With ``env.observation_format: chat`` the agent loop does not append an observation as text
inside the assistant's message; it ends the assistant's turn and adds the observation as a
message of its own (role ``env.observation_role``: ``tool`` or ``user``), then the header of the
next assistant turn, exactly as the chat template writes them — the format that chat models
trained on tool use with TRL or verl expect (Qwen-style:
``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``).

One episode's :class:`ChatTurns` holds the conversation so far: the prompt (a text prompt is one
user message), then per turn the assistant's action (its text, minus a sampled eos) and the
observation. After an action it renders the conversation with the observation's message and the
generation prompt, the assistant's message replaced by :data:`SENTINEL`, and appends what the
template writes after the sentinel: its closing of the assistant's turn as it is when that message
follows (``<|im_end|>\\n``), the observation's message and the next assistant header, generation
prompt included (``<|im_start|>assistant\\n``, plus ``<think>\\n\\n</think>\\n\\n`` under a Qwen3
template with ``chat_template_kwargs: {enable_thinking: false}``). The model's own text is never
what the template's output is split on, so a template that trims a message's spaces, or that
renders an assistant message differently by where it stands, still works. Earlier ids are never
re-tokenized: the new text is encoded as a continuation of the context
(:meth:`~saorl.models.codec.RunTokenizer.continuation_ids`), exact for byte-level BPE and for
SentencePiece tokenizers, whose dummy prefix would otherwise put a space before it.

Token in, token out — not a re-rendering. The trajectory is the prompt's ids followed, per turn,
by the action's ids as sampled and the ids appended after it: what the model conditioned on and
what it sampled, and so what it is trained on. For a template that renders each message the same
wherever it stands that is also the template's rendering of the whole conversation. For one that
does not, it is not, by design. Qwen3's template (and the templates derived from it) writes a
``<think>\\n…\\n</think>\\n\\n`` block into an assistant message after the last user query only when
it is the last message or has reasoning, and drops the reasoning of messages before that query:
with ``enable_thinking: false`` the model was prompted with an empty think block every turn, and
the trajectory keeps each one, where a re-rendering of the conversation would drop all but the
last (with ``observation_role: user`` each observation is a new query, so a re-rendering drops
earlier reasoning too; the trajectory keeps what was sampled).

The closing after a sampled eos: when the action ended on the eos token and the template writes
the eos text between the assistant's message and the observation's text (``<|im_end|>`` after an
``<|im_end|>`` eos), the sampled eos is that one, so only what follows it is added
(``\\n<|im_start|>user...``) — never a second eos. When the action ended on a stop string instead
(``</tool>``), or on an eos the template does not write there, the whole closing is added after it.
Spaces a template puts between the generation prompt and the last message (Mistral's ``[/INST] ``)
are the model's to sample: an action that starts with them enters the conversation without them.
Every appended token is context: ``action_mask`` 0, so skip-observation GAE and the losses see only
the model's own tokens.

What cannot work this way raises :class:`TemplateSplitError`, one paragraph naming the problem: a
template that does not write the assistant's message once, as it is (it drops earlier assistant
messages, repeats them, or changes their text: its case, an escape), so that the sentinel cannot
be found; one whose text after the message depends on what the message says (a different closing
after a tool call, say), so that the text after the sentinel is not what follows the model's own
message; a template that fails on the roles; a tokenizer without a template. :func:`check_chat_turns`
plays a probe episode so that the run's start-up checks raise these before anything runs, and
checks the construction's invariant: each appended part decodes, after the ids before it, to
exactly the template's text.
"""

from __future__ import annotations

from typing import Any

from saorl.models.codec import RunTokenizer

SENTINEL = "SAORLxASSISTANTxMESSAGE"
"""Stands for the assistant's message in the rendering whose tail is appended: letters only, so
nothing a template trims or escapes and no markup it parses (a ``</think>`` split, say); its
lower-case x's make a change of case show."""
OBSERVATION_SENTINEL = "SAORLxOBSERVATION"
"""Stands for the observation's text to tell apart where the template starts writing it."""
PROBE_PROMPT = "What is 12 + 30?"
PROBE_ACTION = "<answer>42</answer>"
"""The assistant's message that tells apart the spaces a template puts before it (no edge spaces,
which some templates trim)."""
PROBE_TURNS = (("<tool>12 + 30</tool>", "<out>42</out>"), ("<answer>42", "<out>ok</out>"))
"""(action, observation) pairs of the start-up probe; the first action ends on eos, the second
does not (as one that ends on a stop string: its closing is added in full)."""

_FIX = ("Use a chat template that writes each assistant message as it is, once, and closes it the same "
        "whatever it says (set model.tokenizer to a tokenizer directory whose tokenizer_config.json has "
        "one), or set env.observation_format=text to append observations as text inside the assistant's "
        "message")


class TemplateSplitError(ValueError):
    """The chat template cannot add an observation as a turn after the conversation so far."""


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _parting(a: str, b: str) -> str:
    k = _common(a, b)
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
        """The conversation so far, as a dataset would hold it."""
        prompted = self._render(self.messages, generation_prompt=True)
        probe = self._render([*self.messages, {"role": "assistant", "content": PROBE_ACTION}],
                             generation_prompt=False)
        at = probe.find(PROBE_ACTION, len(prompted))
        lead = probe[len(prompted):at] if probe.startswith(prompted) and at >= 0 else ""
        self.lead = "" if lead.strip() else lead
        """Spaces the template puts between the generation prompt and the last assistant message
        (``" "`` after Mistral's ``[/INST]``): the model samples them itself (SentencePiece's ``▁``),
        so an action that starts with them is its message without them. Anything else there (the
        empty think block a Qwen3 template writes into the last message) is not stripped."""
        self.appended: list[str] = []
        """The text appended after each action so far: the template's, from after its eos where a
        sampled eos stood for that one."""

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

    def _after_message(self, *messages: dict[str, Any]) -> str:
        """What the template writes after the assistant's message when ``messages`` and the
        generation prompt follow it (the message's own text standing in as :data:`SENTINEL`)."""
        rendered = self._render([*self.messages, {"role": "assistant", "content": SENTINEL}, *messages],
                                generation_prompt=True)
        n = rendered.count(SENTINEL)
        if n != 1:
            raise TemplateSplitError(
                "env.observation_format=chat: the chat template cannot add an observation as a turn: it does "
                "not write the assistant's message once, as it is (a message "
                f"{SENTINEL!r} followed by a {self.role!r} message appears {n} times in its rendering), so "
                "what it writes after that message cannot be told apart. This happens with a template that "
                "drops earlier assistant messages, repeats them or changes their text (its case, an "
                f"escape). {_FIX}")
        return rendered[rendered.index(SENTINEL) + len(SENTINEL):]

    def observation_ids(self, ids: list[int], action: str, observation: str | list[str]) -> list[int]:
        """The ids to append after ``ids`` (the trajectory so far, ending with the action whose
        text, minus a sampled eos, is ``action``): the closing of the assistant's turn, the
        observation's message (one per text for a list: a turn's tool results) and the next
        assistant header (see the module docstring)."""
        content = action[len(self.lead):] if self.lead and action.startswith(self.lead) else action
        history = [*self.messages, {"role": "assistant", "content": content}]
        texts = [observation] if isinstance(observation, str) else list(observation)
        added = [{"role": self.role, "content": t} for t in texts]
        text = self._after_message(*added)
        real = self._render([*history, *added], generation_prompt=True)
        if not real.endswith(text):
            k = _common(real[::-1], text[::-1])  # the length of the tail they share
            i, j = len(real) - k, len(text) - k
            raise TemplateSplitError(
                "env.observation_format=chat: the chat template cannot add an observation as a turn after "
                "this action: what it writes after the assistant's message depends on what the message "
                f"says (with the action's text its rendering reads {real[max(0, i - 40):i + 20]!r} where, "
                f"with another text, it reads {text[max(0, j - 40):j + 20]!r}), so the text to append cannot "
                "be told apart from the model's own. This happens with a template that closes an assistant's "
                f"turn by what it contains (another token after a tool call, say). {_FIX}")
        eos = self.codec.eos_token_id
        if ids and eos is not None and ids[-1] == eos:
            eos_text = self.codec.text([eos])
            # the eos the template writes before the observation's text, if any, is the sampled one
            probe = self._after_message({"role": self.role, "content": OBSERVATION_SENTINEL}, *added[1:])
            head = text[:_common(text, probe)]
            cut = head.find(eos_text) if eos_text else -1
            if cut >= 0:
                text = text[cut + len(eos_text):]
        new = self.codec.continuation_ids(list(ids), text)
        self.messages = [*history, *added]
        self.appended.append(text)
        return new


def check_chat_turns(codec: RunTokenizer, role: str) -> None:
    """Play a probe episode of two observations as chat turns; :class:`TemplateSplitError` when the
    template cannot add them (module docstring), or when the ids appended after an action do not
    decode, after the ids before them, to exactly the template's text (a tokenizer that cannot
    encode it exactly after the context). The trajectory is the prompt, then per turn the action
    and that text: not the template's re-rendering of the whole conversation, which a template that
    renders a message by where it stands (Qwen3's think blocks) makes differ from it."""
    turns = ChatTurns(codec, PROBE_PROMPT, role)
    ids = codec.prompt_ids(PROBE_PROMPT)
    eos = codec.eos_token_id
    for k, (action, observation) in enumerate(PROBE_TURNS):
        action = turns.lead + action  # as a model trained on the template samples it
        ids += codec.continuation_ids(ids, action)
        if k == 0 and eos is not None:
            ids.append(eos)
        start = len(ids)
        ids += turns.observation_ids(ids, action, observation)
        got, want = codec.span_text(ids, start, len(ids)), turns.appended[-1]
        if got != want:
            raise TemplateSplitError(
                f"env.observation_format=chat: in a probe episode the ids appended after action {k + 1} "
                f"decode to {got!r}, while the chat template writes {want!r} ({_parting(got, want)}): the "
                "tokenizer cannot encode the template's text exactly after the context. Use the policy's "
                "own tokenizer, or set env.observation_format=text")
