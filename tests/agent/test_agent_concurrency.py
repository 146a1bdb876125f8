"""run_episodes / stream_episodes: overlap of slow env steps, result order, errors, cancellation."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from agent_fakes import FakeEngine, ToyEnv

from saorl.agent import EpisodeError, run_episodes, stream_episodes
from saorl.engines.base import EngineError, SamplingParams
from saorl.envs.base import Progress, Task

SP = SamplingParams(max_new_tokens=16)


def enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


def echo_engine(tok, **kw):
    """Answers each request with the task's prompt text (so results can be matched to tasks)."""
    return FakeEngine(lambda prompt, sp, k: enc(tok, tok.decode(prompt[:4]) + "</a>"), **kw)


def tasks(n):
    return [Task(f"task-{i}", {"q": i}) for i in range(n)]


def test_slow_env_steps_overlap(tok):
    """8 episodes x 2 steps of 0.2 s at concurrency 8 take about one episode's time (0.4 s), not 3.2 s."""
    envs: list[ToyEnv] = []

    def factory():
        envs.append(ToyEnv(step_sleep=0.2, done_after=2))
        return envs[-1]

    t0 = time.perf_counter()
    trajs = asyncio.run(run_episodes(echo_engine(tok), factory, tasks(8), tok, concurrency=8, sampling=SP))
    elapsed = time.perf_counter() - t0
    assert len(trajs) == 8 and all(t.episode.turns == 2 for t in trajs)
    assert elapsed < 1.2, f"8 concurrent episodes took {elapsed:.2f}s; one takes ~0.4s"
    # direct evidence of overlap: all 8 first steps were running at the same moment
    latest_start = max(e.step_times[0][0] for e in envs)
    earliest_end = min(e.step_times[0][1] for e in envs)
    assert latest_start < earliest_end


def test_concurrency_bounds_episodes_in_flight(tok):
    in_flight, peak = 0, 0

    class Counting(ToyEnv):
        def reset(self, task, progress=None):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            return super().reset(task, progress)

        def step(self, action):
            out = super().step(action)
            if out.done:
                nonlocal in_flight
                in_flight -= 1
            return out

    engine = echo_engine(tok, delay=0.005)
    asyncio.run(run_episodes(engine, lambda: Counting(done_after=1), tasks(9), tok,
                             concurrency=3, sampling=SP))
    assert peak == 3


def test_results_in_task_order_and_stream_in_finish_order(tok):
    # task i's step sleeps longer for small i, so episodes finish in reverse order
    class Slow(ToyEnv):
        def reset(self, task, progress=None):
            self.step_sleep = 0.04 * (5 - task.data["q"])
            return super().reset(task, progress)

    ts = tasks(5)
    factory = lambda: Slow(done_after=1)  # noqa: E731
    trajs = asyncio.run(run_episodes(echo_engine(tok), factory, ts, tok, concurrency=5, sampling=SP))
    assert [t.task_id for t in trajs] == [t.id for t in ts]
    for t, task in zip(trajs, ts):  # each trajectory really is its task's episode
        assert tok.decode(t.token_ids[: t.prompt_len]) == f"Q{task.data['q']}:"
        t.validate()

    async def collect():
        return [t.task_id async for t in stream_episodes(echo_engine(tok), factory, ts, tok,
                                                         concurrency=5, sampling=SP)]

    assert asyncio.run(collect()) == [t.id for t in reversed(ts)]


def test_duplicate_tasks_are_allowed(tok):
    ts = [Task("same", {"q": 1})] * 3
    trajs = asyncio.run(run_episodes(echo_engine(tok), lambda: ToyEnv(done_after=1), ts, tok,
                                     concurrency=2, sampling=SP))
    assert len(trajs) == 3 and {t.task_id for t in trajs} == {"same"}


def test_stream_reads_an_infinite_task_source_lazily_and_progress_callable(tok):
    step = itertools.count()
    envs: list[ToyEnv] = []

    def factory():
        envs.append(ToyEnv(done_after=1))
        return envs[-1]

    source = (Task(f"t{i}", {"q": i}) for i in itertools.count())

    async def take(n):
        gen = stream_episodes(echo_engine(tok), factory, source, tok, concurrency=2, sampling=SP,
                              progress=lambda: Progress(trainer_step=next(step)))
        out = []
        async for traj in gen:
            out.append(traj)
            if len(out) == n:
                break
        await gen.aclose()
        return out

    out = asyncio.run(take(5))
    assert len(out) == 5
    assert len(envs) <= 5 + 2  # never more than `concurrency` episodes beyond those consumed
    # progress is read as each episode starts (an env cancelled before its reset ran has none)
    seen = [(k, e.progress.trainer_step) for k, e in enumerate(envs) if e.progress is not None]
    assert len(seen) >= 5 and all(k == step for k, step in seen)


def test_engine_error_in_one_episode_surfaces_with_its_task_id(tok):
    def script(prompt, sp, k):
        if tok.decode(prompt).startswith("Q3:"):
            raise EngineError("boom")
        return enc(tok, "ok</a>")

    with pytest.raises(EngineError, match=r"task 'task-3'.*boom"):
        asyncio.run(run_episodes(FakeEngine(script), lambda: ToyEnv(done_after=1), tasks(6), tok,
                                 concurrency=3, sampling=SP))


def test_env_error_cancels_the_others(tok):
    started: list[int] = []

    class FailsOnTwo(ToyEnv):
        def reset(self, task, progress=None):
            started.append(task.data["q"])
            self.fail_in = "step" if task.data["q"] == 2 else None
            return super().reset(task, progress)

    t0 = time.perf_counter()
    with pytest.raises(EpisodeError, match="task-2"):
        asyncio.run(run_episodes(echo_engine(tok, delay=0.05), lambda: FailsOnTwo(done_after=50),
                                 tasks(50), tok, concurrency=4, sampling=SP, max_turns=50))
    assert time.perf_counter() - t0 < 2.0
    assert len(started) < 50  # the remaining tasks were never started


def test_bad_concurrency(tok):
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(run_episodes(echo_engine(tok), ToyEnv, tasks(1), tok, concurrency=0, sampling=SP))
