"""The agent loop: turns between an inference engine and an environment → one :class:`Trajectory`.

One episode::

    ids  = prompt_ids(env.reset(task, progress))             # prompt (text or messages), action_mask 0
    loop up to max_turns:
        r    = await engine.agenerate(ids, params)           # stop = sampling.stop + env.stop_strings
        ids += r.token_ids                                   # action_mask 1, r.logprobs, r.versions
        env.note_action_ids(r.token_ids)
        out  = env.step(text of r.token_ids minus a final eos, after ids)
        rewards[last action token of this turn] += out.reward
        if out.done or a limit is hit: stop
        ids += observation_ids(ids, out.observation)         # action_mask 0, logprob 0, version -1

Token exactness: earlier text is NEVER re-tokenized. ``traj.token_ids`` is exactly the prompt ids,
then each turn's sampled ids as the engine returned them, then each observation's ids. An
observation is appended per the env's ``observation_format`` (the run's ``env.observation_format``
when set): ``text``, its text right after the action, inside the assistant's message
(``continuation_ids``); ``chat``, the closing of the assistant's turn, the observation as a
message of role ``observation_role`` and the next assistant header, as the chat template writes
them after the assistant's message (:class:`saorl.models.chat_turns.ChatTurns`; a template that
cannot add them so is an :class:`EpisodeError`, which the start-up checks raise before a run). The text
side goes through :class:`saorl.models.codec.RunTokenizer` (a plain HF tokenizer is wrapped with
the default prompt format): a text prompt through the chat template when the tokenizer has one
(else after its BOS), a prompt of chat messages through the chat template always, each action's
text decoded in its context and each observation encoded so that it appends exactly its text,
for byte-level BPE and SentencePiece tokenizers alike. So
``decode(traj.token_ids)`` equals the decoded prompt + actions + observations as text (with
``chat``, each observation's turn as the template writes it after the assistant's message), with
no space inserted or lost at a boundary, even where the sampled ids are not the canonical
tokenization of the action text. The trajectory is what the model saw and sampled, not a
re-rendering of the conversation: under a Qwen3 template, which drops the think blocks of earlier
turns when it renders a whole conversation, they stay.

Decisions that the trainer and the env authors rely on:

- **eos stays in the trajectory.** A turn that ends on the eos token keeps it (it was sampled,
  has a logprob, and learning *when* to stop is part of the policy); only the text handed to
  ``env.step`` drops it. The eos id is added to the request's ``stop_token_ids``. With ``chat``
  observations a sampled eos that the template's closing of the assistant's turn contains
  (``<|im_end|>``) is that closing's: only what follows it is added, never a second one.
- **Masks.** Everything the loop appends that the model did not sample is context
  (``action_mask`` 0): the observation, and with ``chat`` the closing of the assistant's turn, the
  observation's message with its role header and the next assistant header; the model's own
  tokens, eos included, are the action tokens.
- **Rewards** go on the last action token of the turn that earned them (docs/method.md credits a
  reward on a non-action position to the last action position before it; this places it there
  directly). Turns whose action was cut by a length limit are still stepped: the env decides
  what a cut action is worth.
- **The last observation is not tokenized.** Nothing is sampled after it, so it carries no
  training signal; it is kept as text in ``episode.final_observation`` (for rendering).
- **Limits.** ``max_turns`` (``env.max_turns`` when None) and ``max_total_tokens`` (prompt +
  actions + observations). Each turn's ``max_new_tokens`` is capped by the tokens left. When an
  observation does not fit with room for at least one more action token, the episode ends
  there (the observation is never cut: a garbled tool output would teach the wrong thing).
  Ending by a limit rather than by ``done`` sets ``truncated=True`` and
  ``episode.truncation`` to ``"turns"`` or ``"tokens"``. A prompt that leaves no room for a
  single action token raises :class:`PromptTooLongError`. A task with a ``prompt_limit``
  (``env.overlong_prompts: truncate``) has a prompt over it cut to fit, keeping its end
  (:mod:`saorl.agent.prompt_cut`), before anything else.
- **Action text.** ``env.step`` gets the text all sampled ids of the turn add after the context
  (minus a final eos; a SentencePiece action sampled as ``"▁foo"`` reads ``" foo"``). Engines
  keep the token that completes a stop string whole, so the text may run a few characters past
  the stop string; envs should search for it, not assume it ends the text.
  A multi-byte character split across a turn boundary decodes to U+FFFD in that turn's text
  (the ids, and so the trajectory, are unaffected).
- **Prefix reuse.** Every request of an episode carries one ``SamplingParams.session`` (unique per
  episode), and each turn's context extends the previous one's tokens, so an engine that keeps a
  session's KV cache (the local engine) prefills only the new observation tokens. When the
  episode ends, however it ends, the loop ends the session (the engine frees its last row).
- **Seeds.** With ``sampling.seed`` set, each request gets a seed derived from it, the task id,
  ``sample_index`` and the turn number: reproducible, yet episodes and turns do not replay one
  random stream. :func:`run_episodes` / :func:`stream_episodes` pass a task's position as
  ``sample_index``, so a task listed twice gets two different samples.
- **Tools.** An env with tools (``env.toolbox``: ``env.tools``) plays through
  :class:`saorl.agent.tool_turns.ToolTurns`: the schemas go into the prompt (through the chat
  template's ``tools=`` or the system message), a reply with tool calls is answered by the calls'
  results (one ``tool`` message each, observation ids) without calling ``env.step``, and a reply
  without calls (or the last turn's) goes to ``env.step`` after ``env.note_completion``. Tool
  errors are results the model reads, never an :class:`EpisodeError`.
- **Env metrics.** The last step's ``info["metrics"]`` (optional: names → finite numbers) becomes
  ``episode.env_metrics``; anything else there is an env bug (:class:`EpisodeError`).
- **Errors.** :class:`EngineError` propagates with the task id prefixed; an aborted or empty
  generation is an :class:`EngineError` too. Any exception from the env (``reset`` or ``step``)
  is an env bug and surfaces as :class:`EpisodeError` naming the env and the task; a call into
  user code past its deadline (``env.call_timeout_s``: :class:`~saorl.envs.hosted.CallTimeout`)
  is :class:`EpisodeTimeout`, with the timeout's own message (what ran, the task, the deadline).

``env.reset`` and ``env.step`` run in a thread executor so that sandboxed tool calls of one
episode overlap decoding of the others.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from saorl.agent.prompt_cut import fitted_prompt
from saorl.agent.tool_turns import ToolTurns
from saorl.data.task import Task
from saorl.data.trajectory import Episode, Trajectory
from saorl.engines.base import EngineError, GenerationResult, InferenceEngine, SamplingParams
from saorl.engines.prefix import end_session
from saorl.envs.base import Env, Progress, Prompt, StepResult
from saorl.envs.hosted import CallTimeout
from saorl.models.chat_turns import ChatTurns, TemplateSplitError
from saorl.models.codec import RunTokenizer, as_run_tokenizer

ProgressSource = Progress | Callable[[], Progress] | None


class EpisodeError(RuntimeError):
    """The environment raised during an episode (an env bug, not a policy failure)."""


class EpisodeTimeout(EpisodeError):
    """A call into user code (a reward function, a custom env's reset or step) ran past its
    deadline and was killed: the episode failed, through no fault of the policy or of saorl."""


class PromptTooLongError(EpisodeError):
    """The prompt alone leaves no room for an action under ``max_total_tokens``."""


@dataclass
class _Builder:
    """Per-token lists of the trajectory under construction, plus per-turn bookkeeping."""

    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[list[int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    routes: list[list[int]] | None = None
    """The last turn's engine routes: they cover every token of the context and all but the last
    sampled token (the engine fed exactly those to the model)."""

    def add_context(self, ids: list[int]) -> None:
        n = len(ids)
        self.token_ids += ids
        self.action_mask += [0] * n
        self.logprobs += [0.0] * n
        self.rewards += [0.0] * n
        self.versions += [-1] * n

    def add_action(self, res: GenerationResult) -> None:
        start = len(self.token_ids)
        n = len(res.token_ids)
        self.token_ids += list(res.token_ids)
        self.action_mask += [1] * n
        self.logprobs += [float(x) for x in res.logprobs]
        self.rewards += [0.0] * n
        self.versions += [int(v) for v in res.versions]
        self.turn_spans.append([start, start + n])
        self.finish_reasons.append(res.finish_reason)
        self.routes = res.routes

    def add_reward(self, reward: float) -> None:
        self.rewards[self.turn_spans[-1][1] - 1] += float(reward)
        self.turn_rewards.append(float(reward))


def _routes(b: _Builder) -> list[list[int]] | None:
    """The trajectory's routes: the last turn's, plus ``-1`` for its last sampled token (never fed
    to the model); None when the engine recorded none (or not for every position)."""
    if not b.routes or len(b.routes) != len(b.token_ids) - 1:
        return None
    return [*b.routes, [-1] * len(b.routes[0])]


def _check_result(res: GenerationResult, params: SamplingParams) -> None:
    n = len(res.token_ids)
    if len(res.logprobs) != n or len(res.versions) != n:
        raise EngineError(f"engine returned {n} tokens but {len(res.logprobs)} logprobs and "
                          f"{len(res.versions)} versions")
    if res.finish_reason == "abort":
        raise EngineError("generation was aborted")
    if n == 0:
        raise EngineError("engine returned no tokens")
    if n > params.max_new_tokens:
        raise EngineError(f"engine returned {n} tokens, more than max_new_tokens={params.max_new_tokens}")


def _turn_params(sampling: SamplingParams, env: Env, eos_id: int | None, left: int,
                 seed_key: str, session: str, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
    stop = tuple(dict.fromkeys((*sampling.stop, *env.stop_strings, *extra_stop)))
    stop_ids = tuple(dict.fromkeys((*sampling.stop_token_ids, *(() if eos_id is None else (eos_id,)))))
    seed = None if sampling.seed is None else zlib.crc32(f"{sampling.seed}/{seed_key}".encode())
    return replace(sampling, stop=stop, stop_token_ids=stop_ids, seed=seed,
                   max_new_tokens=min(sampling.max_new_tokens, left), session=session)


async def _call_env(fn: Callable[..., Any], *args: Any, env: Env, task: Task, what: str,
                    expect: type | tuple[type, ...], executor: Executor | None) -> Any:
    loop = asyncio.get_running_loop()
    try:
        out = await loop.run_in_executor(executor, fn, *args)
    except CallTimeout as e:
        raise EpisodeTimeout(str(e)) from None
    except Exception as e:
        raise EpisodeError(f"env {env.name!r} raised in {what} on {task.label}: "
                           f"{type(e).__name__}: {e}") from e
    if not isinstance(out, expect):
        names = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise EpisodeError(f"env {env.name!r} {what} on task {task.id!r} returned {type(out).__name__}, "
                           f"expected {names}")
    return out


async def _generate(engine: InferenceEngine, ids: list[int], params: SamplingParams,
                    task: Task) -> GenerationResult:
    try:
        res = await engine.agenerate(list(ids), params)
        _check_result(res, params)
    except EngineError as e:
        raise EngineError(f"task {task.id!r}: {e}") from e
    return res


class _Observations:
    """The ids of an episode's observations, per its env's ``observation_format``."""

    def __init__(self, codec: RunTokenizer, env: Env, task: Task, prompt: Prompt) -> None:
        self.codec, self.where = codec, f"env {env.name!r} task {task.id!r}"
        self.turns = None
        if env.observation_format == "chat":
            try:
                self.turns = ChatTurns(codec, prompt, env.observation_role)
            except TemplateSplitError as e:
                raise EpisodeError(f"{self.where}: {e}") from None

    def ids(self, ids: list[int], action: str, observation: str | list[str]) -> list[int]:
        if self.turns is None:
            return self.codec.continuation_ids(ids, _as_text(observation))
        try:
            return self.turns.observation_ids(ids, action, observation)
        except TemplateSplitError as e:
            raise EpisodeError(f"{self.where}: {e}") from None


def _as_text(observation: str | list[str]) -> str:
    """An observation as text: a turn's tool results (a list) each in ``<tool_response>`` tags, as
    Hermes writes them, for ``observation_format: text``."""
    if isinstance(observation, str):
        return observation
    return "".join(f"\n<tool_response>\n{text}\n</tool_response>" for text in observation) + "\n"


async def _step(env: Env, action: str, tools: ToolTurns | None, kw: dict[str, Any]) -> StepResult:
    """The env's answer to ``action``; with tools, the calls' results when it makes calls
    (:mod:`saorl.agent.tool_turns`), the env's step otherwise, with the episode's tool counts."""
    if tools is not None:
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(kw["executor"], tools.run, action)
        if results is not None:
            return StepResult(results, 0.0, False, {"metrics": tools.metrics()})  # type: ignore[arg-type]
        env.note_completion(list(tools.completion))
    out = await _call_env(env.step, action, what="step", expect=StepResult, **kw)
    if tools is not None:
        metrics = out.info.get("metrics", {})
        if isinstance(metrics, Mapping):
            out.info = {**out.info, "metrics": {**metrics, **tools.metrics()}}
    return out


def _action_text(codec: RunTokenizer, ids: list[int], start: int) -> str:
    """The text of ``ids[start:]`` (this turn's action) in its context, minus a final eos."""
    end = len(ids)
    if end > start and ids[-1] == codec.eos_token_id:
        end -= 1
    return codec.span_text(ids, start, end)


async def run_episode(engine: InferenceEngine, env: Env, task: Task, tokenizer: Any, *,
                      sampling: SamplingParams, max_turns: int | None = None,
                      max_total_tokens: int = 512, progress: Progress | None = None,
                      env_executor: Executor | None = None, sample_index: int = 0) -> Trajectory:
    """Play one episode of ``env`` on ``task`` with ``engine``; see the module docstring.

    ``env`` must be fresh (one episode per instance). ``env_executor`` runs ``reset``/``step``
    (the event loop's default thread pool when None). ``sample_index`` tells apart several
    episodes of one task when ``sampling.seed`` is set (see "Seeds" in the module docstring).
    """
    if (max_turns is not None and max_turns < 1) or max_total_tokens < 2:
        raise ValueError(f"need max_turns >= 1 and max_total_tokens >= 2, "
                         f"got max_turns={max_turns}, max_total_tokens={max_total_tokens}")
    kw = dict(env=env, task=task, executor=env_executor)
    codec = as_run_tokenizer(tokenizer)
    t0 = time.perf_counter()
    prompt = await _call_env(env.reset, task, progress, what="reset", expect=(str, list), **kw)
    # read after reset: an env may set its turn limit per task (a mix sets its part's)
    max_turns = env.max_turns if max_turns is None else max_turns
    if max_turns < 1:
        raise EpisodeError(f"env {env.name!r} task {task.id!r}: max_turns is {max_turns}, must be >= 1")
    env_s, gen_s = time.perf_counter() - t0, 0.0
    tools = None if env.toolbox is None else _tool_turns(env, codec, task, max_turns)
    if tools is not None:
        codec, prompt = tools.codec(codec), tools.prompt(prompt)
    b = _Builder()
    prompt, ids = _fitted(codec, prompt, task, env)  # cut to task.prompt_limit if it is over
    b.add_context(ids)
    observations = _Observations(codec, env, task, prompt)
    prompt_len = len(b.token_ids)
    if prompt_len == 0:
        raise EpisodeError(f"env {env.name!r} returned an empty prompt for task {task.id!r}")
    if prompt_len >= max_total_tokens:
        raise PromptTooLongError(f"env {env.name!r} task {task.id!r}: prompt has {prompt_len} tokens, "
                                 f"max_total_tokens={max_total_tokens} leaves no room for an action")
    truncation: str | None = None
    out = StepResult("", 0.0, False)
    session = f"{task.id}/{sample_index}/{uuid.uuid4().hex}"  # this episode's turns share a KV prefix
    try:
        while True:
            params = _turn_params(sampling, env, codec.eos_token_id, max_total_tokens - len(b.token_ids),
                                  seed_key=f"{task.id}/{sample_index}/{len(b.turn_spans)}", session=session,
                                  extra_stop=() if tools is None else tools.stop_strings)
            t0 = time.perf_counter()
            res = await _generate(engine, b.token_ids, params, task)
            gen_s += time.perf_counter() - t0
            b.add_action(res)
            t0 = time.perf_counter()
            action = _action_text(codec, b.token_ids, b.turn_spans[-1][0])
            env.note_action_ids(list(res.token_ids))
            out = await _step(env, action, tools, kw)
            env_s += time.perf_counter() - t0
            b.add_reward(out.reward)
            if out.done:
                break
            if len(b.turn_spans) >= max_turns:
                truncation = "turns"
                break
            obs_ids = observations.ids(b.token_ids, action, out.observation)
            if len(b.token_ids) + len(obs_ids) + 1 > max_total_tokens:
                truncation = "tokens"
                break
            b.add_context(obs_ids)
    finally:
        end_session(engine, session)  # its last turn's KV row is of no further use
    episode = Episode(
        env=env.name, turns=len(b.turn_spans), success=bool(out.info.get("success", False)),
        final_reward=float(out.reward), turn_rewards=b.turn_rewards, turn_spans=b.turn_spans,
        finish_reasons=b.finish_reasons, final_observation=_as_text(out.observation), truncation=truncation,
        gen_seconds=gen_s, env_seconds=env_s, env_metrics=_env_metrics(out.info, env, task))
    return Trajectory(token_ids=b.token_ids, action_mask=b.action_mask, rollout_logprobs=b.logprobs,
                      rewards=b.rewards, versions=b.versions, prompt_len=prompt_len, task_id=task.id,
                      truncated=truncation is not None, episode=episode, routes=_routes(b))


def _tool_turns(env: Env, codec: RunTokenizer, task: Task, max_turns: int) -> ToolTurns:
    try:
        return ToolTurns(env.toolbox, codec, max_turns)
    except ValueError as e:  # a tool without a schema: the start-up checks name it first
        raise EpisodeError(f"env {env.name!r} task {task.id!r}: {e}") from None


def _fitted(codec: RunTokenizer, prompt: str | list, task: Task, env: Env) -> tuple[str | list, list[int]]:
    """The prompt and its ids; with ``task.prompt_limit``, the prompt cut to it if it is over (the
    chat observations then render the conversation from the cut prompt: what the model saw)."""
    if task.prompt_limit is None:
        return prompt, codec.prompt_ids(prompt)
    fitted = fitted_prompt(codec, prompt, task.prompt_limit)
    if fitted is None:
        raise PromptTooLongError(f"env {env.name!r} task {task.id!r}: the prompt cannot be cut to "
                                 f"{task.prompt_limit} tokens (env.overlong_prompts=truncate): the chat "
                                 "template and system messages alone are over")
    return fitted


def _env_metrics(info: dict[str, Any], env: Env, task: Task) -> dict[str, float]:
    """The last step's ``info["metrics"]``, checked: a mapping of names to finite numbers."""
    metrics = info.get("metrics", {})
    if not isinstance(metrics, Mapping):
        raise EpisodeError(f"env {env.name!r} on task {task.id!r}: info['metrics'] must be a dict of "
                           f"numbers, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not (isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v)):
            raise EpisodeError(f"env {env.name!r} on task {task.id!r}: info['metrics'][{k!r}] must be a "
                               f"finite number under a string key, got {v!r}")
        out[k] = float(v)
    return out


def _resolve_progress(progress: ProgressSource) -> Progress | None:
    return progress() if callable(progress) else progress


async def _stream_indexed(engine: InferenceEngine, env_factory: Callable[[], Env], tasks: Iterable[Task],
                          tokenizer: Any, *, concurrency: int, progress: ProgressSource,
                          env_executor: Executor | None, **episode_kw: Any,
                          ) -> AsyncIterator[tuple[int, Trajectory]]:
    """(position in ``tasks``, trajectory) pairs in finishing order; see :func:`stream_episodes`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    own = ThreadPoolExecutor(concurrency, thread_name_prefix="saorl-env") if env_executor is None else None
    executor = env_executor or own
    it = enumerate(tasks)
    running: dict[asyncio.Task[Trajectory], int] = {}

    def launch() -> bool:
        nxt = next(it, None)
        if nxt is None:
            return False
        fut = asyncio.ensure_future(run_episode(
            engine, env_factory(), nxt[1], tokenizer, progress=_resolve_progress(progress),
            env_executor=executor, sample_index=nxt[0], **episode_kw))
        running[fut] = nxt[0]
        return True

    try:
        while len(running) < concurrency and launch():
            pass
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=running.__getitem__):
                index = running.pop(fut)
                traj = fut.result()  # raises the episode's error; `finally` cancels the rest
                launch()
                yield index, traj
    finally:
        for fut in running:
            fut.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        if own is not None:
            own.shutdown(wait=False, cancel_futures=True)


async def stream_episodes(engine: InferenceEngine, env_factory: Callable[[], Env], tasks: Iterable[Task],
                          tokenizer: Any, *, concurrency: int, sampling: SamplingParams,
                          max_turns: int | None = None, max_total_tokens: int = 512,
                          progress: ProgressSource = None,
                          env_executor: Executor | None = None) -> AsyncIterator[Trajectory]:
    """Yield one trajectory per task, in the order episodes finish, ``concurrency`` at a time.

    ``tasks`` is read lazily, so it may be infinite (the rollout worker: one rollout per prompt,
    forever). ``env_factory()`` makes a fresh env per episode. ``progress`` may be a callable,
    read when each episode starts (so envs see the trainer step at their start). The first
    episode error cancels the episodes in flight and is raised; ``aclose()`` on the generator
    cancels them too. Without ``env_executor`` a private pool of ``concurrency`` threads runs
    the env calls, so ``concurrency`` slow ``step`` calls really overlap (the event loop's
    default pool can be smaller than that).
    """
    async for _, traj in _stream_indexed(
            engine, env_factory, tasks, tokenizer, concurrency=concurrency, progress=progress,
            env_executor=env_executor, sampling=sampling, max_turns=max_turns,
            max_total_tokens=max_total_tokens):
        yield traj


async def run_episodes(engine: InferenceEngine, env_factory: Callable[[], Env], tasks: Iterable[Task],
                       tokenizer: Any, *, concurrency: int, sampling: SamplingParams,
                       max_turns: int | None = None, max_total_tokens: int = 512,
                       progress: ProgressSource = None,
                       env_executor: Executor | None = None) -> list[Trajectory]:
    """Run one episode per task, ``concurrency`` at a time on one engine; results in task order.

    The same task may appear more than once (e.g. several samples per prompt for evaluation).
    """
    tasks = list(tasks)
    out: list[Trajectory | None] = [None] * len(tasks)
    async for index, traj in _stream_indexed(
            engine, env_factory, tasks, tokenizer, concurrency=concurrency, progress=progress,
            env_executor=env_executor, sampling=sampling, max_turns=max_turns,
            max_total_tokens=max_total_tokens):
        out[index] = traj
    return [t for t in out if t is not None]
