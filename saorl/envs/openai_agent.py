"""``openai_agent``: an agent program that calls the model through the OpenAI API, trained as it is.

The agent is a coroutine named by ``env.options.agent`` (``"module.path:function"``)::

    async def agent(task: dict, client: openai.AsyncOpenAI) -> float | dict

``task`` is the task's row (``env.tasks_file`` / ``env.dataset``, :mod:`saorl.data.tasks`), ``client``
an ``openai.AsyncOpenAI`` whose base URL is an endpoint of this episode served by the run's engine;
it returns the reward, or ``{"reward": float, "success": bool, "metrics": {name: number}}``. The
agent owns its loop: its prompts, its tools, how it reads the replies. What saorl makes of its
calls (recorded ids, how calls join into one trajectory or into segments, what is refused) is
:mod:`saorl.agent.openai_episode`; the endpoint is :mod:`saorl.agent.openai_proxy`.

This class is the env's configuration and the agent's import: a typo in ``agent`` fails when the
run starts. It has no ``reset``/``step`` episode: the rollout worker plays it with
:func:`saorl.agent.openai_episode.play_agent_episode` instead of the agent loop. ``reset`` returns the
row's ``prompt_column`` (when the row has one), which is what the start-up screen of prompt
lengths (``env.overlong_prompts``) measures; the agent's real prompts are checked call by call (a
call whose prompt leaves no room for one token under ``rollout.max_total_tokens`` is refused to the
agent). The agent runs under ``env.call_timeout_s`` as a whole (:attr:`Env.call_timeout_s`, stamped
by the env factory).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.registry import EnvResolveError, import_object
from saorl.envs.tool_calls import TOOL_CALL_FORMATS

__all__ = ["TOOL_FORMATS", "AgentResult", "OpenAIAgentEnv", "agent_result"]

TOOL_FORMATS = TOOL_CALL_FORMATS
"""The formats ``tool_format`` may name (:data:`saorl.envs.tool_calls.TOOL_CALL_FORMATS`)."""


class AgentResult:
    """What an agent's return value says: the reward, success and its own metrics."""

    def __init__(self, reward: float, success: bool, metrics: dict[str, float]) -> None:
        self.reward, self.success, self.metrics = reward, success, metrics


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r:.80}")
    return float(value)


def agent_result(value: Any, success_threshold: float, where: str) -> AgentResult:
    """The agent's return value checked: a number, or ``{"reward", "success", "metrics"}``
    (``success`` defaults to ``reward >= success_threshold``); ``ValueError`` naming ``where``."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"reward", "success", "metrics"})
        if unknown or "reward" not in value:
            raise ValueError(f"{where} returned a dict with keys {sorted(value)}; it must hold 'reward' and "
                             "may hold 'success' (bool) and 'metrics' (names to numbers)")
        reward = _number(value["reward"], f"{where}: 'reward'")
        success = value.get("success", reward >= success_threshold)
        if not isinstance(success, bool):
            raise ValueError(f"{where}: 'success' must be true or false, got {success!r:.80}")
        metrics = value.get("metrics") or {}
        if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
            raise ValueError(f"{where}: 'metrics' must map names to numbers, got {metrics!r:.80}")
        checked = {k: _number(v, f"{where}: metric {k!r}") for k, v in metrics.items()}
        return AgentResult(reward, success, checked)
    reward = _number(value, f"{where}: the reward it returned")
    return AgentResult(reward, reward >= success_threshold, {})


def load_agent(spec: str) -> Callable[..., Any]:
    """The agent coroutine function named by ``spec``; :class:`EnvResolveError` saying what is wrong."""
    if not isinstance(spec, str):
        raise EnvResolveError(f"agent must be a 'module.path:function' string, got {spec!r:.80}")
    fn = import_object(spec, f"agent {spec!r}")
    if not inspect.iscoroutinefunction(fn):
        raise EnvResolveError(f"agent {spec!r} must be an async function, async def agent(task: dict, "
                              f"client: openai.AsyncOpenAI) -> float | dict; got {type(fn).__name__}")
    return fn


class OpenAIAgentEnv(Env):
    name: ClassVar[str] = "openai_agent"

    def __init__(self, agent: str | None = None, success_threshold: float = 0.5,
                 prompt_column: str = "prompt", tool_format: str = "hermes", model: str = "policy",
                 **options: Any) -> None:
        """Options: ``agent`` (required: ``module.path:function``, an async function (task, client) ->
        reward or dict), ``success_threshold`` (0.5: success is reward >= it when the agent does not
        say), ``prompt_column`` ("prompt": what the start-up screen of prompt lengths measures),
        ``tool_format`` ("hermes": how the model's tool calls are read when a call gives ``tools``,
        one of :data:`saorl.envs.tool_calls.TOOL_CALL_FORMATS`), ``model`` ("policy": the model name
        the endpoint serves, which the agent's calls pass as ``model``)."""
        super().__init__(**options)
        if agent is None:
            raise ValueError("agent is required: env.options.agent=module.path:function, an async function "
                             "(task: dict, client: openai.AsyncOpenAI) -> float | dict")
        if not isinstance(success_threshold, (int, float)) or not math.isfinite(success_threshold):
            raise ValueError(f"success_threshold must be a finite number, got {success_threshold!r}")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {list(TOOL_FORMATS)}, got {tool_format!r}")
        try:
            import openai  # noqa: F401  # the client the agent is given
        except ImportError:
            raise ValueError("openai_agent gives the agent an openai.AsyncOpenAI client, and the openai "
                             "package is not installed: pip install 'saorl[openai]'") from None
        self.agent_spec = agent
        self.agent = load_agent(agent)
        self.success_threshold = float(success_threshold)
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty name, got {model!r}")
        self.prompt_column, self.tool_format, self.model = prompt_column, tool_format, model

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        raise ValueError("openai_agent has no task generator: give the agent's tasks with env.tasks_file "
                         "(JSONL, parquet or a datasets directory) or env.dataset.path")

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        prompt = task.data.get(self.prompt_column)
        return prompt if isinstance(prompt, (str, list)) and prompt else ""

    def step(self, action: str) -> StepResult:
        raise RuntimeError("openai_agent episodes are played by the agent program "
                           "(saorl.agent.openai_episode), not step by step")

    def call_site(self, method: str, task: Task) -> str:
        return f"openai agent {self.agent_spec!r} on task {task.id!r}"
