"""The schedule (RolloutFeed + AsyncDispatch / SyncDispatch) on the in-process backend.

A fake engine answers at once (or after a per-task delay), so each test runs in well under a
second with no subprocess: the staleness bound, the sync barrier, whole GRPO groups, re-queue of
failed rollouts, max_staleness drops and the exactly-once hand-off across a checkpoint + crash.
"""

from __future__ import annotations

import asyncio
import random
from typing import ClassVar

import pytest

from saorl.data.task import Task
from saorl.engines.base import GenerationResult, SamplingParams
from saorl.envs.base import Env, Progress, StepResult
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.backends.inprocess import InProcessBackend
from saorl.runtime.backends.messages import PollResult
from saorl.runtime.journal import Journal, RangeSet, RolloutCursor
from saorl.runtime.schedule import TIMEOUTS_IN_A_ROW, AsyncDispatch, RolloutFeed, SyncDispatch


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


class FastEngine:
    """Two tokens per turn, tagged with the engine's version; ``delay(prompt)`` seconds first."""

    def __init__(self, delay=lambda prompt: 0.0) -> None:
        self.version, self.delay, self.calls = 0, delay, 0

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        self.calls += 1
        version = self.version
        d = self.delay(prompt_ids)
        if d:
            await asyncio.sleep(d)
        return GenerationResult([300, 301], [-0.5, -0.25], "stop", [version, version])

    def update_weights(self, weights, version: int) -> None:
        self.version = version

    def stats(self) -> dict[str, float]:
        return {"requests": float(self.calls)}

    def close(self) -> None:
        pass


class MemoryWeights:
    """A weight publisher and source in one that only carries version numbers (the fake engine
    needs no tensors)."""

    def __init__(self) -> None:
        self.version: int | None = None

    def publish(self, buckets, version: int, names=None) -> None:
        self.version = version

    def latest(self):
        return None if self.version is None else (self.version, f"mem://v{self.version}")

    def load(self, version=None):
        return None


class OneTurnEnv(Env):
    """One action, reward 1; ``fail_times[task id]`` first attempts of a task raise in step."""

    name = "one-turn"
    fail_times: ClassVar[dict[str, int]] = {}

    def generate_tasks(self, split, n, seed):
        return [Task(f"{split}-{i}", {"q": i}) for i in range(n)]

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        self.task = task
        return f"Q{task.data['q']}:"

    def step(self, action: str) -> StepResult:
        left = OneTurnEnv.fail_times.get(self.task.id, 0)
        if left:
            OneTurnEnv.fail_times[self.task.id] = left - 1
            raise RuntimeError(f"flaky env on {self.task.id}")
        return StepResult("", 1.0, True, {"success": True})


class Harness:
    """A feed on an in-process backend, and a trainer that bumps the version after each batch."""

    def __init__(self, tmp_path, tok, policy, *, batch_size=4, group_size=1, slots=8, tasks=50,
                 max_staleness=None, delay=lambda prompt: 0.0, finished=None) -> None:
        self.engine, self.weights = FastEngine(delay), MemoryWeights()
        self.version = 0
        self.weights.publish([{}], 0)
        self.backend = InProcessBackend(self.engine, OneTurnEnv, tok,
                                        sampling=SamplingParams(max_new_tokens=4), max_total_tokens=64,
                                        concurrency=slots, weights=self.weights)
        self.tasks = OneTurnEnv().generate_tasks("train", tasks, 0)
        self.journal = Journal(tmp_path / "journal")
        self.logs: list[str] = []
        self.feed = RolloutFeed(self.backend, self.tasks, RolloutCursor(finished), self.journal, policy,
                                group_size=group_size, batch_size=batch_size, version=lambda: self.version,
                                progress=Progress, max_staleness=max_staleness, log=self.logs.append)

    def __enter__(self) -> Harness:
        self.backend.start()
        self.feed.start()
        return self

    def __exit__(self, *exc) -> None:
        self.feed.stop()
        self.backend.shutdown()
        self.journal.close()

    def step(self):
        """One trainer step: take a batch, then publish the next version."""
        trajs, gids, _ = self.feed.next_batch(self.version)
        version_at_batch = self.version
        self.version += 1
        self.weights.publish([{}], self.version)
        return trajs, gids, version_at_batch


def test_async_hands_each_rollout_to_the_trainer_once_and_bounds_staleness(tmp_path, tok):
    slots, batch = 8, 4
    with Harness(tmp_path, tok, AsyncDispatch(), batch_size=batch, slots=slots) as h:
        trained = []
        for _ in range(12):
            trajs, _, version = h.step()
            assert len(trajs) == batch
            trained += [t.episode.rid for t in trajs]
            # in flight + waiting never exceeds slots + one batch, so a trajectory is at most that
            # many batches old when it is trained
            assert max(t.staleness(version) for t in trajs) <= (slots + batch) // batch
        journalled = [t.episode.rid for t in h.journal.read_from(0)]
    assert len(trained) == len(set(trained)) == 48
    assert set(trained) <= set(journalled) and len(journalled) == len(set(journalled))
    assert h.feed.stats.requeued == 0


def test_sync_dispatches_one_batch_with_the_current_weights(tmp_path, tok):
    with Harness(tmp_path, tok, SyncDispatch(), batch_size=4, slots=16) as h:
        for _ in range(5):
            trajs, _, version = h.step()
            assert len(trajs) == 4
            assert {v for t in trajs for v in t.action_versions} == {version}  # the barrier
        assert h.feed.stats.finished == 20  # exactly one batch per step, nothing ahead


def test_groups_are_whole_and_share_their_task(tmp_path, tok):
    rng = random.Random(0)
    delays: dict[tuple[int, ...], float] = {}

    def delay(prompt):  # members of a group finish in a random order
        return delays.setdefault((*prompt, len(delays)), rng.random() * 0.01)

    with Harness(tmp_path, tok, AsyncDispatch(), batch_size=8, group_size=4, slots=12, delay=delay) as h:
        for _ in range(4):
            trajs, gids, _ = h.step()
            assert len(trajs) == 8
            by_group: dict[int, list] = {}
            for t, g in zip(trajs, gids):
                by_group.setdefault(g, []).append(t)
            for seq, members in by_group.items():
                assert sorted(t.episode.rid for t in members) == [4 * seq + k for k in range(4)]
                assert {t.task_id for t in members} == {h.tasks[seq % len(h.tasks)].id}
                assert {t.episode.group for t in members} == {seq}  # the worker carried it back


def test_failed_rollouts_are_requeued_then_fail_loudly(tmp_path, tok):
    OneTurnEnv.fail_times = {"train-1": 2, "train-2": 1}
    with Harness(tmp_path, tok, AsyncDispatch(), batch_size=4, slots=4) as h:
        trained = []
        for _ in range(3):
            trained += [t.episode.rid for t in h.step()[0]]
        assert h.feed.stats.requeued == 3
        assert len(trained) == len(set(trained)) == 12 and {1, 2} <= set(trained)
        assert sum("flaky env" in m for m in h.logs) == 3
    OneTurnEnv.fail_times = {"train-0": 10}
    with (Harness(tmp_path / "b", tok, AsyncDispatch(), batch_size=4, slots=4) as h,
          pytest.raises(RuntimeError, match=r"rollout 0 \(task train-0\) failed 4 times")):
        for _ in range(10):
            h.step()


@pytest.fixture(autouse=True)
def _no_flaky_tasks_left():
    yield
    OneTurnEnv.fail_times = {}


def test_max_staleness_drops_old_rollouts(tmp_path, tok):
    with Harness(tmp_path, tok, AsyncDispatch(), batch_size=2, slots=8, max_staleness=0,
                 delay=lambda p: 0.002) as h:
        for _ in range(6):
            trajs, _, version = h.step()
            assert all(t.staleness(version) == 0 for t in trajs)
        assert h.feed.stats.dropped_stale > 0


def test_checkpoint_then_crash_trains_every_finished_rollout_exactly_once(tmp_path, tok):
    with Harness(tmp_path, tok, AsyncDispatch(), batch_size=4, slots=8) as h:
        first = [t.episode.rid for _ in range(3) for t in h.step()[0]]
        ranges, pending, seg = h.feed.checkpoint_state()
        after_ckpt = [t.episode.rid for _ in range(2) for t in h.step()[0]]  # lost in the crash
    # resume as saorl.runtime.resume.restore does: the checkpoint's finished set and pending, then
    # the journal after it
    finished = RangeSet.from_ranges(ranges)
    journal = Journal(tmp_path / "journal")
    for traj in journal.read_from(seg):
        if traj.episode.rid not in finished:
            finished.add(traj.episode.rid)
            pending.append(traj)
    journal.close()
    assert {t.episode.rid for t in pending} >= set(after_ckpt)  # redone, not lost
    with Harness(tmp_path, tok, AsyncDispatch(), batch_size=4, slots=8, finished=finished) as h:
        h.feed.restore_pending(pending)
        second = [t.episode.rid for _ in range(6) for t in h.step()[0]]
    trained = first + second
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    assert set(after_ckpt) <= set(second), "a rollout trained after the checkpoint was lost"
    assert {t.episode.rid for t in pending} <= set(second)  # what was pending goes first


class EveryCallTimesOut:
    """A backend whose every rollout runs past its deadline (user code that always hangs)."""

    restarts = 0

    def __init__(self) -> None:
        self.pending: list[int] = []

    def start(self) -> None: ...
    def ready(self) -> bool: return True
    def free_slots(self) -> int: return 4 - len(self.pending)
    def submit(self, req) -> None: self.pending.append(req.rid)
    def engine_stats(self) -> dict: return {}
    def shutdown(self) -> None: ...

    def poll(self, timeout_s: float) -> PollResult:
        lost, self.pending = self.pending, []
        return PollResult(lost=lost, timeouts={rid: f"EpisodeTimeout: reward function 'r:hang' on rollout "
                                                    f"{rid} did not return within 60 s" for rid in lost})


def test_user_code_that_hangs_on_every_call_stops_the_run_after_a_wave_or_two(tmp_path, tok):
    tasks = OneTurnEnv().generate_tasks("train", 50, 0)
    feed = RolloutFeed(EveryCallTimesOut(), tasks, RolloutCursor(), Journal(tmp_path / "j"), AsyncDispatch(),
                       group_size=1, batch_size=4, version=lambda: 0, progress=Progress, log=lambda m: None)
    feed.start()
    try:
        with pytest.raises(RuntimeError) as info:
            feed.next_batch(0)
    finally:
        feed.stop()
    msg = str(info.value)
    assert f"the last {TIMEOUTS_IN_A_ROW} rollouts all ran past env.call_timeout_s" in msg, msg
    assert "seems to hang on every call" in msg and "reward function 'r:hang'" in msg
    assert "failed 4 times" not in msg  # two waves of 4, not four tries of one rollout
