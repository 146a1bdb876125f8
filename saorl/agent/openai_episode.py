"""One episode of an OpenAI-API agent (``env.type: openai_agent``) → one :class:`Trajectory`.

::

    token  = proxy.open(episode)                          # this episode's endpoint
    client = openai.AsyncOpenAI(base_url=".../ep/<token>/v1", api_key="saorl", max_retries=0)
    value  = await agent(task.data, client)               # in a thread of its own, under the deadline
    proxy.close(token)                                    # later calls: 410 (or refused), not recorded
    return calls joined into segments, the reward on each segment's last action token

What each call records and how calls join: :mod:`saorl.agent.openai_record`; what a call may ask
and what is refused: :mod:`saorl.agent.openai_calls`; the endpoint: :mod:`saorl.agent.openai_proxy`.

**Where the agent runs.** In a thread of its own with its own event loop, not in the worker's:
an agent that blocks (a synchronous HTTP call, ``time.sleep``, a CPU-bound step) would otherwise
stop the worker's loop, which serves every episode's calls and drives the engine, and with it
every other episode of the worker, and its own calls could never be answered. The worker's loop
waits for the agent's result until the agent's own time passes ``env.call_timeout_s`` (None: no
deadline). The agent's own time is the episode's wall clock less the time its calls spent waiting on
the model (while at least one call is in the engine the clock stops): a slow engine, a loaded CPU or
a long queue of other episodes' requests does not eat into the agent's deadline, which bounds what
the agent does itself (its code, its tools, a hang). Past it, the episode is closed (its calls get
410), the agent's task is cancelled
in its loop, and the rollout fails with :class:`~saorl.agent.loop.EpisodeTimeout`, which the run
reports as any user code past its deadline. An agent blocked in a call that never yields cannot be
stopped from outside its thread: that thread is left behind as a daemon, its calls refused. When
the agent returns, the tasks it started and left running are cancelled with its loop
(``asyncio.run``), and any call they make after the episode ends is refused.

**Failures.** An agent that raises, returns something that is not a reward, or makes no call at
all fails the rollout with :class:`~saorl.agent.loop.EpisodeError` naming the agent and the task
(the worker reports it as it reports an env that raised); an engine failure during a call fails it
with :class:`~saorl.engines.base.EngineError`, whatever the agent made of the error it was answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from saorl.agent import openai_calls as calls
from saorl.agent.loop import EpisodeError, EpisodeTimeout
from saorl.agent.openai_proxy import open_episode
from saorl.data.task import Task
from saorl.data.trajectory import Episode, Trajectory
from saorl.engines.base import EngineError, InferenceEngine, SamplingParams
from saorl.engines.prefix import end_session
from saorl.envs.openai_agent import OpenAIAgentEnv, agent_result
from saorl.models.codec import as_run_tokenizer


class _Deadline(Exception):
    """The agent ran past its deadline."""


class _AgentThread:
    """The agent's coroutine run in a daemon thread with its own event loop (module docstring)."""

    def __init__(self, agent: Callable[..., Any], task: dict[str, Any], base_url: str) -> None:
        self.agent, self.task, self.base_url = agent, task, base_url
        self.done: concurrent.futures.Future = concurrent.futures.Future()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.main: asyncio.Task | None = None

    async def _run(self) -> Any:
        import openai

        self.loop, self.main = asyncio.get_running_loop(), asyncio.current_task()
        async with openai.AsyncOpenAI(base_url=self.base_url, api_key="saorl", max_retries=0) as client:
            return await self.agent(self.task, client)

    def _thread(self) -> None:
        try:
            result = asyncio.run(self._run())
        except BaseException as e:  # handed to the worker's loop, which raises it
            if not self.done.done():
                self.done.set_exception(e)
            return
        if not self.done.done():
            self.done.set_result(result)

    async def run(self, timeout_s: float | None, waited: Callable[[float], float]) -> Any:
        """The agent's return value (its exception raised); :class:`_Deadline` once its own time
        passes ``timeout_s``: the wall clock since it started less ``waited(now)``, the seconds its
        calls spent in the engine (module docstring)."""
        threading.Thread(target=self._thread, name="saorl-openai-agent", daemon=True).start()
        fut = asyncio.wrap_future(self.done)
        t0 = time.perf_counter()
        while True:
            left = None
            if timeout_s is not None:
                now = time.perf_counter()
                left = timeout_s - (now - t0 - waited(now))
                if left <= 0:
                    fut.cancel()
                    raise _Deadline
            finished, _ = await asyncio.wait({fut}, timeout=left)
            if finished:
                return fut.result()

    def stop(self) -> None:
        """Cancel the agent's coroutine if it still runs (a no-op once it has ended)."""
        loop, main = self.loop, self.main
        if loop is not None and main is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(main.cancel)
            except RuntimeError:  # the loop closed in between
                pass


async def play_agent_episode(engine: InferenceEngine, env: OpenAIAgentEnv, task: Task, tokenizer: Any, *,
                             sampling: SamplingParams, max_total_tokens: int,
                             sample_index: int = 0) -> Trajectory:
    """Play one episode of ``env``'s agent on ``task`` (module docstring)."""
    codec = as_run_tokenizer(tokenizer)
    ep = calls.Episode(engine, codec, sampling, max_total_tokens, env.model,
                       seed_key=f"{task.id}/{sample_index}",
                       session=f"{task.id}/{sample_index}/{uuid.uuid4().hex}", tool_format=env.tool_format)
    proxy, token = await open_episode(ep)
    runner = _AgentThread(env.agent, dict(task.data), proxy.url(token))
    where = env.call_site("run", task)
    t0, why = time.perf_counter(), "the agent returned"
    try:
        value = await runner.run(env.call_timeout_s, ep.engine_seconds)
    except _Deadline:
        why = f"the agent ran past env.call_timeout_s={env.call_timeout_s}s"
        waited = ep.engine_seconds(time.perf_counter())
        raise EpisodeTimeout(f"{where} ran past its deadline of {env.call_timeout_s}s of its own time "
                             f"(env.call_timeout_s; the {waited:.1f}s its calls waited on the model not "
                             "counted) and was cancelled") from None
    except Exception as e:
        why = f"the agent raised {type(e).__name__}"
        if ep.error is not None:
            raise EngineError(f"task {task.id!r}: {ep.error}") from ep.error
        raise EpisodeError(f"{where} raised: {type(e).__name__}: {e}") from e
    finally:
        proxy.close(token, why)
        runner.stop()
        end_session(engine, ep.session)  # the last call's KV row is of no further use
    seconds = time.perf_counter() - t0
    if ep.error is not None:
        raise EngineError(f"task {task.id!r}: {ep.error}") from ep.error
    try:
        result = agent_result(value, env.success_threshold, where)
    except ValueError as e:
        raise EpisodeError(str(e)) from None
    if not ep.log.calls:
        raise EpisodeError(f"{where} made no chat.completions call with the client it was given: there is "
                           "nothing to train on")
    episode = Episode(env=env.name, success=result.success, gen_seconds=ep.gen_seconds,
                      env_seconds=max(seconds - ep.gen_seconds, 0.0),
                      env_metrics=result.metrics)
    return ep.log.trajectory(task.id, result.reward, episode)
