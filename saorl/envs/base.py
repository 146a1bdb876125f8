"""The environment protocol: text in / text out for the env author, token-exact for the trainer.

An :class:`Env` instance runs one episode at a time (the agent loop makes a fresh instance per
episode, so ``__init__`` must be cheap). The loop is::

    prompt = env.reset(task, progress)          # first observation: text, or chat messages
    while True:
        action = <policy samples text until one of env.stop_strings>
        env.note_action_ids(ids of that action)  # optional hook; the default ignores them
        result = env.step(action)               # observation, reward, done, info
        if result.done: break

The agent loop (``saorl.agent``) turns this into token ids without ever re-tokenizing earlier
text; env authors never see tokens (unless they keep what ``note_action_ids`` gives). The prompt
is text, which goes to the model as one user message through its chat template (when it has
one), or a list of ``{"role", "content"}`` messages (a system message among them, say), which
goes through the chat template as it is: a model without a template cannot take it
(:meth:`saorl.models.codec.RunTokenizer.prompt_ids`). Rewards may be given at every turn. The final
``StepResult.info["success"]`` (bool) is what evaluation accuracy counts; an optional final
``info["metrics"]`` (names → finite numbers) is kept on the episode (``Episode.env_metrics``) and
logged as batch means, ``env/<name>`` per trainer step and ``eval/env/<name>`` per evaluation.

Code saorl does not ship — a reward function, an env class from outside the ``saorl`` package —
runs with a deadline (``env.call_timeout_s``): the run wraps such an env in
:class:`saorl.envs.hosted.HostedEnv`, whose ``reset`` and ``step`` run in a warm child process
that is killed when a call runs past it. Such an env must pickle (its state crosses a process
boundary with every call). ``calls_user_code`` marks a built-in env that calls user code
(``prompt_reward``); :meth:`Env.call_site` names what a call runs, for the timeout's message.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from saorl.data.task import Task

Split = Literal["train", "test"]
Prompt = str | list[dict[str, Any]]
"""What ``reset`` returns: the prompt text, or a conversation (``{"role", "content"}`` messages)."""

OBSERVATION_FORMATS = ("text", "chat")
"""How an observation joins the trajectory (:attr:`Env.observation_format`)."""
OBSERVATION_ROLES = ("tool", "user")
"""The roles of an observation's message under ``chat`` (:attr:`Env.observation_role`)."""

__all__ = ["OBSERVATION_FORMATS", "OBSERVATION_ROLES", "Env", "Progress", "Prompt", "Split", "StepResult",
           "Task", "prompt_text"]


def prompt_text(prompt: Prompt) -> str:
    """A prompt as text for people (``saorl envs sample``): a conversation as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)


@dataclass(frozen=True)
class Progress:
    """Where training is, for envs whose reward moves with it (``style_shift``)."""

    trainer_step: int = 0
    episode: int = 0


@dataclass
class StepResult:
    observation: str | list[str]
    """Text the environment appends after the action ('' for none); a list, several messages of
    the observation role under ``observation_format: chat`` (what the agent loop makes of a turn's
    tool calls: one result each), each in ``<tool_response>`` tags under ``text``."""
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    name: ClassVar[str] = "env"
    stop_strings: ClassVar[tuple[str, ...]] = ()
    """Strings that end one action turn (e.g. '</tool>', '</answer>')."""
    version: ClassVar[int] = 1
    """Bump when the env's prompts, observations, rewards or demonstrations change: the cached SFT
    warm starts and pretrained critics are keyed on it, so they are rebuilt, not reused stale."""
    max_turns: int = 4
    observation_format: str = "text"
    """How the agent loop adds an observation to the trajectory: ``text`` appends its text right
    after the action, inside the assistant's message; ``chat`` ends the assistant's turn and adds it
    as a message of role :attr:`observation_role` through the chat template, then the next assistant
    header (:mod:`saorl.models.chat_turns`). The run's ``env.observation_format`` overrides it."""
    observation_role: str = "tool"
    """The role of an observation's message under ``chat``: ``tool`` or ``user`` (the run's
    ``env.observation_role`` overrides it)."""
    call_timeout_s: float | None = None
    """The run's ``env.call_timeout_s``, set by the env factory on every env it makes: the deadline of
    an env that runs user code in the worker's process itself (``openai_agent``'s agent)."""
    tools: tuple[str, ...] = ()
    """Tools the model may call natively (``module.path:function`` each, typed and documented as
    TRL's ``tools=`` takes them; :mod:`saorl.envs.toolbox`): the agent loop writes their schemas
    into the prompt, runs the model's calls and returns their results as ``tool`` messages, and
    calls :meth:`step` only with a reply that calls no tool (:mod:`saorl.agent.tool_turns`). The
    run's ``env.tools``, when set, replaces them."""
    toolbox: Any = None
    """The :class:`saorl.envs.toolbox.Tools` the run's env factory gives an env that has tools
    (None: no tools). Set by the factory; env authors declare :attr:`tools` instead."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Modules of optional packages the env plays (``("textarena",)``): resolving the env checks
    they import, and names the extra to install when not (:mod:`saorl.envs.extras`)."""
    calls_user_code: ClassVar[bool] = False
    """True for a built-in env whose ``reset`` / ``step`` call code given by the user (a reward
    function): they run under ``env.call_timeout_s`` like those of an env class from outside saorl."""
    reward_only_options: ClassVar[tuple[str, ...]] = ()
    """Options that change only the reward, not the tasks, prompts or demonstrations: the cached SFT
    warm start is keyed without them (its data does not depend on them), so changing one reuses it."""

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options: {sorted(options)}")

    @abstractmethod
    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """Deterministic in ``seed``; train and test task ids never overlap."""

    @abstractmethod
    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        """Start an episode and return the prompt: text, or a list of chat messages."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action (the decoded text the policy sampled this turn)."""

    def note_action_ids(self, ids: list[int]) -> None:
        """The token ids the policy sampled for the action about to be stepped (eos included), given
        by the agent loop right before ``step``; envs played as text never get them. Ignored here."""
        del ids

    def note_completion(self, messages: list[dict[str, Any]]) -> None:
        """In an episode with tools, the completion so far as chat messages (TRL's form: each
        assistant turn with its ``tool_calls``, each ``tool`` result, and last the reply about to
        be stepped), given by the agent loop right before a :meth:`step`. Ignored here."""
        del messages

    def call_site(self, method: str, task: Task) -> str:
        """What a call of ``method`` (``"reset"`` or ``"step"``) on ``task`` runs, for a message
        about it (a call past its deadline). Must not depend on the episode's state."""
        return f"env {self.name!r} ({type(self).__qualname__}.{method}) on {task.label}"

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Actions of a (sometimes deliberately suboptimal) demonstration for SFT."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations")
