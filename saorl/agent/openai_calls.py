"""One ``chat.completions.create`` of an agent's episode: the request checked, rendered, sampled,
recorded and answered as the OpenAI API answers it.

The request is read with ``saorl serve``'s schemas (:mod:`saorl.engines.serve.openai_api`: strict
types, finite numbers, an unknown field is a 400 naming it), with messages that may carry the
``tool_calls`` of the model's earlier replies. Then:

- **Refused** (HTTP 400 naming the field, as the OpenAI API words its errors): ``model`` other
  than the served name (``env.options.model``, default ``policy``), ``n`` > 1 (one rollout per
  task), a ``logit_bias`` with a non-zero bias and every other field of
  :data:`~saorl.engines.serve.openai_fields.UNHONOURED` away from its neutral value (penalties,
  ``min_p``, ``response_format``, ...): the trainer scores the tokens under the distribution the
  engine samples, which these would change. Also
  ``top_p`` / ``top_k`` other than the run's (``rollout.top_p`` / ``top_k``), ``tool_choice``
  ``required`` or naming a function (nothing forces a call), ``chat_template_kwargs``, and
  ``add_generation_prompt: false`` / ``continue_final_message`` (the episode's template and turns
  are the run's).
- **Honoured**: ``messages`` through the run's chat template (:meth:`RunTokenizer.prompt_ids
  <saorl.models.codec.RunTokenizer.prompt_ids>`); ``tools`` (through the template where it takes
  them, else as a system-prompt block, :mod:`saorl.agent.openai_tools`; the reply's calls parsed
  into ``tool_calls``); ``max_tokens`` / ``max_completion_tokens`` (capped by
  ``rollout.max_new_tokens`` and by what ``rollout.max_total_tokens`` leaves after the prompt);
  ``stop``, ``stop_token_ids``; ``temperature`` (unset: the run's; the engine records the
  log-probs of the distribution that sampled, so DIS's ratio corrects for a temperature other than
  the trainer's, and masks the tokens where it is far); ``seed``; ``logprobs`` / ``top_logprobs``;
  ``stream`` (the reply as OpenAI streams it: a role event, the content, the tool calls, the finish
  event, a usage event with ``stream_options.include_usage``, then ``data: [DONE]``; sent once the
  reply is sampled).
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import Field

from saorl.agent.openai_record import Call, CallLog
from saorl.agent.openai_tools import ToolRendering
from saorl.engines.base import EngineError, GenerationResult, InferenceEngine, SamplingParams
from saorl.engines.serve import openai_api as oa
from saorl.engines.serve import openai_out as out
from saorl.engines.serve.openai_fields import UNHONOURED
from saorl.models.codec import RunTokenizer


class AgentMessage(oa.ChatMessage):
    """A chat message as an agent sends it back: an assistant's may carry its ``tool_calls``, and the
    reply's other keys, which the ``openai`` client sends with a reply appended as it came (read and
    ignored: they hold nothing that is rendered)."""
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    reasoning: str | None = None


class AgentChatRequest(oa.ChatRequest):
    messages: Annotated[list[AgentMessage], Field(min_length=1, max_length=1024)]


class Refused(oa.BadRequest):
    """A request the episode's endpoint answers with an HTTP error (400 unless ``status``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message, param)
        self.status = status


@dataclass(frozen=True)
class _Served:
    """What :mod:`saorl.engines.serve.openai_out` reads of a server, for the episode's endpoint."""
    name: str
    eos_token_id: int | None
    fingerprint: str | None = None


@dataclass
class _State:
    tokenizer: RunTokenizer
    served: _Served
    emulate: None = None
    route_layout: None = None
    emulation: None = None


@dataclass
class Episode:
    """An episode's endpoint: what its calls run on and what they recorded."""

    engine: InferenceEngine
    codec: RunTokenizer
    sampling: SamplingParams
    max_total_tokens: int
    model_name: str
    seed_key: str
    session: str
    tool_format: str = "hermes"
    log: CallLog | None = None
    gen_seconds: float = 0.0
    """Seconds the episode's calls spent in the engine (summed over calls, parallel ones too)."""
    in_engine: int = 0
    """Calls of the episode in the engine now."""
    busy_seconds: float = 0.0
    """Seconds during which at least one call was in the engine, up to the last that left it."""
    busy_since: float = 0.0
    error: BaseException | None = None
    """An engine failure during a call: the episode fails with it, whatever the agent made of the 500."""

    def engine_seconds(self, now: float) -> float:
        """Wall seconds (``time.perf_counter``) during which a call of the episode was in the engine,
        up to ``now``: the time the agent waited on the model, not its own."""
        return self.busy_seconds + (now - self.busy_since if self.in_engine else 0.0)

    def enter_engine(self) -> float:
        now = time.perf_counter()
        if not self.in_engine:
            self.busy_since = now
        self.in_engine += 1
        return now

    def leave_engine(self, t0: float) -> None:
        now = time.perf_counter()
        self.gen_seconds += now - t0
        self.in_engine -= 1
        if not self.in_engine:
            self.busy_seconds += now - self.busy_since

    def __post_init__(self) -> None:
        self.log = self.log or CallLog()
        self.state = _State(self.codec, _Served(self.model_name, self.codec.eos_token_id))
        self.tools = ToolRendering(self.codec, self.tool_format)


def check(ep: Episode, body: Any) -> AgentChatRequest:
    """The request parsed, or :class:`Refused` naming what training cannot honour (module docstring)."""
    req = oa.parse(AgentChatRequest, body)
    if req.model is not None and req.model != ep.model_name:
        raise Refused(f"model: this endpoint serves {ep.model_name!r}, the run's policy, which is what is "
                      f"trained; got {req.model!r}", "model")
    if req.n != 1:
        raise Refused(f"n: one rollout per call is recorded for training; got n={req.n}", "n")
    for name, (neutral, says) in UNHONOURED.items():
        value = getattr(req, name, None)
        if name not in ("tools", "tool_choice") and value is not None and not neutral(value):
            raise Refused(f"{name}: the trainer scores the sampled tokens under the engine's temperature, "
                          f"top-k and top-p only, so {name}={str(value)[:80]} cannot be trained on; leave it "
                          f"out or send {says}", name)
    for name, run_value in (("top_p", ep.sampling.top_p), ("top_k", ep.sampling.top_k)):
        value = getattr(req, name)
        off = name == "top_k" and value in (-1, 0) and not run_value  # -1 and 0 both mean no top-k
        if value is not None and value != run_value and not off:
            raise Refused(f"{name}: the trainer scores with the run's {name}={run_value} (rollout.{name}); "
                          f"got {value}. Leave it out", name)
    if req.tool_choice not in (None, "auto", "none"):
        raise Refused("tool_choice: only 'auto' and 'none' can be honoured (nothing forces the model to "
                      f"call a tool); got {str(req.tool_choice)[:80]}", "tool_choice")
    if req.chat_template_kwargs:
        raise Refused("chat_template_kwargs: the episode's prompts are rendered with the run's template and "
                      "its model.chat_template_kwargs", "chat_template_kwargs")
    if not req.add_generation_prompt or req.continue_final_message:
        raise Refused("add_generation_prompt: each call samples a new assistant turn (add_generation_prompt "
                      "true, continue_final_message false)", "add_generation_prompt")
    return req


def _params(ep: Episode, req: AgentChatRequest, prompt_len: int, index: int) -> SamplingParams:
    left = ep.max_total_tokens - prompt_len
    if left < 1:
        raise Refused(f"messages: the prompt has {prompt_len} tokens, and the run's rollout.max_total_tokens="
                      f"{ep.max_total_tokens} leaves no room for a reply", "messages")
    asked = req.max_completion_tokens or req.max_tokens or ep.sampling.max_new_tokens
    eos = () if ep.codec.eos_token_id is None else (int(ep.codec.eos_token_id),)
    stop_ids = tuple(dict.fromkeys((*ep.sampling.stop_token_ids, *eos, *(req.stop_token_ids or ()))))
    seed = req.seed if req.seed is not None else ep.sampling.seed
    if seed is not None:
        seed = zlib.crc32(f"{seed}/{ep.seed_key}/{index}".encode())
    temperature = ep.sampling.temperature if req.temperature is None else req.temperature
    return replace(ep.sampling, temperature=temperature,
                   max_new_tokens=min(asked, ep.sampling.max_new_tokens, left),
                   stop=tuple(dict.fromkeys((*ep.sampling.stop, *req.stops()))), stop_token_ids=stop_ids,
                   seed=seed, session=ep.session, top_logprobs=req.top_logprobs or 0)


async def sample(ep: Episode, req: AgentChatRequest) -> tuple[list[int], GenerationResult]:
    """Render, sample and record one call; the prompt ids and the engine's result."""
    try:
        prompt = ep.tools.prompt_ids([m.model_dump(exclude_none=True) for m in req.messages], req.tools)
    except ValueError as e:
        raise Refused(f"messages: {e}"[:600], "messages") from None
    params = _params(ep, req, len(prompt), len(ep.log.calls))
    t0 = ep.enter_engine()
    try:
        try:
            res = await ep.engine.agenerate(list(prompt), params)
        finally:
            ep.leave_engine(t0)
        if res.finish_reason == "abort" or not res.token_ids or len(res.logprobs) != len(res.token_ids):
            raise EngineError(f"the engine returned {len(res.token_ids)} tokens ({res.finish_reason})")
    except EngineError as e:
        ep.error = e
        raise Refused(f"the run's engine failed: {e}"[:600], None, status=500) from None
    return prompt, res


def record(ep: Episode, prompt: list[int], res: GenerationResult) -> None:
    ep.log.add(Call.of(prompt, res))


def reply(ep: Episode, req: AgentChatRequest, prompt: list[int], res: GenerationResult) -> dict:
    """The response body (non-streaming), as the OpenAI API writes it."""
    choice = out.chat_choice(ep.state, req, 0, res, "assistant")
    text = choice["message"]["content"]
    if req.tools and req.tool_choice != "none":
        content, calls = ep.tools.parse(text)
        choice["message"]["content"] = content
        if calls:
            choice["message"]["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
    use = out.usage(len(prompt), len(res.token_ids))
    rid = out.new_id("chatcmpl")
    return out.response(ep.state, True, rid, [choice], use, prompt if req.return_token_ids else None)


def stream_events(ep: Episode, req: AgentChatRequest, body: dict) -> list[str]:
    """The SSE events of ``body`` (a reply), as OpenAI streams one, ending with ``data: [DONE]``."""
    created, rid = body["created"], body["id"]
    choice = body["choices"][0]
    msg = choice["message"]

    def event(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        c = dict(index=0, delta=delta, logprobs=logprobs, finish_reason=finish)
        return "data: " + json.dumps(out.chunk(ep.state, True, rid, created, [c])) + "\n\n"

    events = [event({"role": "assistant", "content": ""})]
    if msg.get("content"):
        events.append(event({"content": msg["content"]}, logprobs=choice.get("logprobs")))
    for i, call in enumerate(msg.get("tool_calls") or []):
        events.append(event({"tool_calls": [dict(index=i, **call)]}))
    events.append(event({}, choice["finish_reason"]))
    if req.stream_options is not None and req.stream_options.include_usage:
        usage = out.chunk(ep.state, True, rid, created, [], usage=body["usage"])
        events.append("data: " + json.dumps(usage) + "\n\n")
    return [*events, "data: [DONE]\n\n"]


def models(ep: Episode) -> dict:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [{"id": ep.model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "saorl", "root": ep.model_name, "parent": None}]}
