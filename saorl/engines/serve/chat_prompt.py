"""A chat request's messages as prompt token ids, through the tokenizer's chat template, as vLLM 0.32
renders them (``vllm/renderers/hf.py``, ``chat_utils.py``).

- A message's ``content`` is a string or a list of content parts; the text parts are joined with
  ``"\\n"`` (vLLM's "string" content format) and a part of another type (``image_url``,
  ``input_audio``, ...) is a 400 naming ``messages``: the models served here are text only. A null
  content renders as the empty string.
- ``add_generation_prompt`` (default true) and ``continue_final_message`` go to the template; both
  true is a 400 (``continue_final_message`` needs ``add_generation_prompt: false``).
- ``chat_template_kwargs`` are passed to the template, those it uses only (its undeclared Jinja
  variables); the others are dropped, as vLLM drops them. They cannot override what the request
  sets through its own fields (``messages``, ``add_generation_prompt``, ...).
- The template renders text, which is then tokenized with ``add_special_tokens`` (chat default
  false: the template writes its special tokens itself).

The response's ``role`` is ``assistant`` when ``add_generation_prompt`` is set, else the last
message's role (vLLM's ``get_chat_request_role``).
"""

from __future__ import annotations

import functools

import jinja2
import jinja2.meta

from saorl.engines.serve import openai_api as oa

_OWN = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize", "chat_template",
                  "tools", "documents", "return_dict", "tokenizer_kwargs"})


def _content(m: oa.ChatMessage, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type != "text" or not isinstance(part.text, str):
            raise oa.BadRequest(f"messages: message {i} has a content part of type {part.type[:64]!r}; "
                                "this server's model takes text only ({\"type\": \"text\", \"text\": ...})",
                                "messages")
        texts.append(part.text)
    return "\n".join(texts)


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def response_role(req: oa.ChatFields) -> str:
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def chat_prompt(tokenizer, req: oa.ChatFields) -> list[int]:
    """The prompt token ids of ``req`` (a chat request or a chat ``/tokenize``); 400s as above."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        raise oa.BadRequest("messages: this model's tokenizer has no chat template, so the server cannot "
                            "turn messages into a prompt; use /v1/completions, or start the server "
                            "with --chat-template FILE", "messages")
    if req.add_generation_prompt and req.continue_final_message:
        raise oa.BadRequest("continue_final_message: cannot be combined with add_generation_prompt (true "
                            "by default): send add_generation_prompt: false", "continue_final_message")
    msgs = []
    for i, m in enumerate(req.messages):
        named = dict(role=m.role, name=m.name, tool_call_id=m.tool_call_id)
        msg = {k: v for k, v in named.items() if v is not None}
        msgs.append(msg | {"content": _content(m, i)})
    names = set().union(*(_template_variables(t) for t in (
        template.values() if isinstance(template, dict) else [template]) if isinstance(t, str)))
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k in names and k not in _OWN}
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             tokenize=False, **extra)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise oa.BadRequest(f"messages: the chat template cannot render these messages: {e}"[:500],
                            "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
