"""A rank with no trajectories makes the same collectives, in the same order, as a rank with some.

A sharded step (FSDP2, :mod:`saorl.runtime.learner.sharded`) runs :meth:`Learner._step_share` on
every rank's share; a rank whose share is empty runs it on an action-free batch with idle passes. If
a new estimator, loss or metric adds a collective on the path of a full share only, the ranks pair
mismatched collectives and hang. Here two ranks run in two threads of this process over a group
that checks, at every collective, that both ranks called the same one with payloads of the same
kind, and fails naming both calls instead of hanging (every rendezvous has a deadline); then the
ranks' model forwards and backwards (where FSDP2 gathers and reduces) must be equally many.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from saorl.runtime.learner.shard_update import ShardedUpdater
from saorl.runtime.learner.sharded import GlobalBaseline
from tests.runtime.learner.test_learner import _learner, _matched_trajs, _trajs

DEADLINE_S = 60.0


class MismatchedCollective(AssertionError):
    pass


class Rendezvous:
    """What two thread ranks share: a barrier with a deadline and one slot per rank."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=DEADLINE_S)
        self.slots: list[Any] = [None, None]
        self.calls: list[list[str]] = [[], []]


class ThreadGroup:
    """The collectives of :class:`~saorl.runtime.learner.shard_group.ShardGroup` between two threads."""

    world = 2
    device = torch.device("cpu")

    def __init__(self, rank: int, rv: Rendezvous) -> None:
        self.rank, self.rv = rank, rv

    def _exchange(self, op: str, obj: Any) -> list[Any]:
        call = f"{op}({type(obj).__name__}{f'[{len(obj)}]' if isinstance(obj, list) else ''})"
        self.rv.calls[self.rank].append(call)
        self.rv.slots[self.rank] = (call, obj)
        try:
            self.rv.barrier.wait()
        except threading.BrokenBarrierError:
            raise MismatchedCollective(f"rank {self.rank} waited in {call}, which the other rank never "
                                       f"called; calls so far: {self.rv.calls}") from None
        (c0, o0), (c1, o1) = self.rv.slots
        self.rv.barrier.wait()
        if c0 != c1:
            raise MismatchedCollective(f"rank 0 called {c0} where rank 1 called {c1}; calls: {self.rv.calls}")
        return [o0, o1]

    def all_sum(self, values: list[float]) -> list[float]:
        a, b = self._exchange("all_sum", list(values))
        return [float(x) + float(y) for x, y in zip(a, b)]

    def all_gather(self, obj: Any) -> list[Any]:
        return self._exchange("all_gather", obj)

    def gather(self, obj: Any) -> list[Any] | None:
        out = self._exchange("gather", obj)
        return out if self.rank == 0 else None


def _two_ranks(name: str, **over) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    rv = Rendezvous()
    learners = []
    for rank in range(2):
        lrn = _learner(name, kind="tiny-dense", **over)
        group = ThreadGroup(rank, rv)
        lrn.updater = ShardedUpdater(group)
        lrn.counters.baseline = GlobalBaseline(lrn.preset.baseline_momentum, group)
        learners.append(lrn)
    trajs = _matched_trajs(learners[0].policy, _trajs(4, seed=3))
    gids = [0, 0, 1, 1] if learners[0].preset.group_size > 1 else [0, 1, 2, 3]
    counts = [[0, 0], [0, 0]]  # per rank: model forwards, backwards
    for rank, lrn in enumerate(learners):
        models = [lrn.policy] + ([lrn.critic] if lrn.critic is not None else [])
        for m in models:
            m.register_forward_hook(lambda *_a, r=rank: counts[r].__setitem__(0, counts[r][0] + 1))
        backward = lrn.updater.backward

        def counted(loss, r=rank, backward=backward):
            counts[r][1] += 1
            backward(loss)
        lrn.updater.backward = counted
    errors: list[BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            share = (trajs, gids) if rank == 0 else ([], [])
            learners[rank]._step_share(*share)
        except BaseException as e:  # reported by the main thread
            errors[rank] = e
            rv.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * DEADLINE_S)
    mismatch = [e for e in errors if isinstance(e, MismatchedCollective)]
    if mismatch:
        raise mismatch[0]
    for e in errors:
        if e is not None:
            raise e
    return rv.calls[0], rv.calls[1], [tuple(c) for c in counts]


@pytest.mark.parametrize("name, over", [
    ("sao", {}), ("sao", {"advantage_norm": "batch"}), ("grpo", {}), ("grpo_dis", {}), ("vapo", {}),
    ("ppo", {}), ("reinforce_rm", {}),
])
def test_an_empty_share_makes_the_collectives_of_a_full_one(name, over):
    full, empty, (work0, work1) = _two_ranks(name, **over)
    assert full == empty and full, "the ranks' collectives differ"
    assert work0 == work1, f"forwards and backwards: full share {work0}, empty share {work1}"


def test_a_collective_on_the_full_path_only_fails_naming_it(monkeypatch):
    """What the check above exists for: an estimator that gathers on a full share only."""
    import saorl.runtime.learner.single as single

    original = single.Learner._advantages

    def gathers_when_full(self, batch, values, gids, empty):
        if not empty:
            self.updater.sum([1.0])
        return original(self, batch, values, gids, empty)

    monkeypatch.setattr(single.Learner, "_advantages", gathers_when_full)
    with pytest.raises(MismatchedCollective, match="all_sum"):
        _two_ranks("sao")
