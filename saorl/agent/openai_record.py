"""An OpenAI-API agent's calls, recorded and joined into token-exact segments.

Each ``chat.completions.create`` of an episode is one :class:`Call`: the prompt ids the run's chat
template gave the request's messages, and the ids the engine sampled with their log-probs and
policy versions. :class:`CallLog` joins them, in the order they finish:

- a call whose prompt ids **start with** all the tokens of a segment so far (the previous call's
  prompt + the ids it sampled) extends that segment: the tokens in between (the template's closing
  of the model's turn, the tool results, the next user message, the next assistant header) are
  observations (``action_mask`` 0), the sampled ids are actions. That is the agent sending the
  conversation back as it received it, when the template renders the model's reply as exactly the
  ids it sampled (plus its closing), the common case;
- any other call starts a **new segment**: the agent cut, summarised or rewrote its history, changed
  the system message, or the template re-rendered the reply differently from the sampled ids
  (stripped whitespace, a reply that ended on a stop string the API does not send back). Nothing is
  ever re-tokenized to force a join. Where several segments could take the call (parallel calls of
  one conversation), the longest does.

:meth:`CallLog.trajectory` gives the episode's :class:`~saorl.data.trajectory.Trajectory`: the last
segment to grow is its own tokens, the others its ``segments``; each segment has the episode's
reward on its last action token, so each is a GAE chain of its own that ends in the reward.
``env/segments_per_episode`` and ``env/calls_per_episode`` are logged through the episode's
``env_metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from saorl.data.trajectory import Episode, Segment, Trajectory
from saorl.engines.base import GenerationResult


@dataclass(frozen=True)
class Call:
    """One recorded call: its prompt ids and what the engine sampled after them."""

    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str

    @classmethod
    def of(cls, prompt_ids: list[int], res: GenerationResult) -> Call:
        return cls(list(prompt_ids), list(res.token_ids), [float(x) for x in res.logprobs],
                   [int(v) for v in res.versions], res.finish_reason)


@dataclass
class _Segment:
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    turn_spans: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def add(self, call: Call) -> None:
        context = call.prompt_ids[len(self.token_ids):]
        if not self.token_ids:
            self.prompt_len = len(context)
        self.token_ids += context
        self.action_mask += [0] * len(context)
        self.logprobs += [0.0] * len(context)
        self.versions += [-1] * len(context)
        start = len(self.token_ids)
        self.token_ids += call.sampled_ids
        self.action_mask += [1] * len(call.sampled_ids)
        self.logprobs += call.logprobs
        self.versions += call.versions
        self.turn_spans.append([start, len(self.token_ids)])
        self.finish_reasons.append(call.finish_reason)

    def extended_by(self, prompt_ids: list[int]) -> bool:
        n = len(self.token_ids)
        return len(prompt_ids) >= n and prompt_ids[:n] == self.token_ids

    def rewards(self, reward: float) -> list[float]:
        out = [0.0] * len(self.token_ids)
        out[self.turn_spans[-1][1] - 1] = float(reward)
        return out


class CallLog:
    """The calls of one episode, joined as they arrive (module docstring)."""

    def __init__(self) -> None:
        self.segments: list[_Segment] = []
        self.calls: list[Call] = []
        self.last: _Segment | None = None
        """The segment the latest call went to."""

    def add(self, call: Call) -> bool:
        """Record ``call``; True when it extended a segment, False when it started one."""
        self.calls.append(call)
        takers = [s for s in self.segments if s.extended_by(call.prompt_ids)]
        seg = max(takers, key=lambda s: len(s.token_ids)) if takers else None
        if seg is None:
            seg = _Segment()
            self.segments.append(seg)
        seg.add(call)
        self.last = seg
        return bool(takers)

    def trajectory(self, task_id: str, reward: float, episode: Episode) -> Trajectory:
        """The episode's trajectory (module docstring); ``episode`` gets the last segment's turns."""
        if self.last is None:
            raise ValueError("no call was recorded")
        main = self.last
        others = [Segment(s.token_ids, s.action_mask, s.logprobs, s.rewards(reward), s.versions, s.prompt_len)
                  for s in self.segments if s is not main]
        episode.turns = len(self.calls)
        episode.turn_spans = main.turn_spans
        episode.finish_reasons = main.finish_reasons
        episode.turn_rewards = [0.0] * (len(main.turn_spans) - 1) + [float(reward)]
        episode.final_reward = float(reward)
        episode.env_metrics = {**episode.env_metrics, "segments_per_episode": float(len(self.segments)),
                               "calls_per_episode": float(len(self.calls))}
        return Trajectory(token_ids=main.token_ids, action_mask=main.action_mask,
                          rollout_logprobs=main.logprobs,
                          rewards=main.rewards(reward), versions=main.versions, prompt_len=main.prompt_len,
                          task_id=task_id, episode=episode, segments=others)
