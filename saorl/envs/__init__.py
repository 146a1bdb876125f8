"""Environments: the :class:`Env` protocol, the built-in envs and the registry that names them.

Built-ins (see :data:`saorl.envs.registry.BUILTIN_ENVS`): ``math_tool`` (multi-turn arithmetic and
countdown with a Python tool), ``math_levels`` (the same at mixed difficulty, the level named in
the prompt), ``noisy_lookup`` (k tool calls with long, noisy observations), ``code_repair`` (fix a
function until its tests pass), ``style_shift`` (online learning: the rewarded writing style
switches during training), ``synthetic`` (a long-tailed workload for benchmarks),
``prompt_reward`` (a dataset's prompt column scored by a user's reward function),
``openai_agent`` (an agent program that calls the model through the OpenAI API, trained as it is), the
community envs of the ``envs`` extra (``reasoning_gym``, ``textarena``, ``openenv``:
:mod:`saorl.envs.extras`) and ``mix`` (several of them in one run, ``env.mix``).
Importing this package imports no env module; :func:`resolve_env` does that lazily.
"""

from saorl.data.tasks import load_tasks
from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.registry import BUILTIN_ENVS, make_env_factory, resolve_env

__all__ = [
    "BUILTIN_ENVS",
    "Env",
    "Progress",
    "Prompt",
    "Split",
    "StepResult",
    "Task",
    "load_tasks",
    "make_env_factory",
    "resolve_env",
]
