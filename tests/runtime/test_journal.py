import itertools
import random

import pytest

from saorl.data.trajectory import Trajectory
from saorl.runtime.journal import Journal, RangeSet, RolloutCursor


def _traj(tid: str) -> Trajectory:
    return Trajectory(token_ids=[5, 6, 7], action_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.5, -1.25],
                      rewards=[0.0, 0.0, 1.0], versions=[-1, 3, 4], prompt_len=1, task_id=tid)


def test_rangeset_matches_python_set():
    rng = random.Random(0)
    rs, ref = RangeSet(), set()
    for _ in range(2000):
        x = rng.randrange(300)
        rs.add(x)
        ref.add(x)
        assert len(rs) == len(ref)
    assert list(rs) == sorted(ref)
    assert all((x in rs) == (x in ref) for x in range(-3, 320))
    # ranges are disjoint, sorted, non-adjacent (maximally merged)
    r = rs.ranges()
    assert all(a[1] < b[0] for a, b in itertools.pairwise(r))
    assert list(RangeSet.from_ranges(r)) == sorted(ref)


def test_rangeset_rejects_bad_input():
    with pytest.raises(ValueError):
        RangeSet().add(-1)
    with pytest.raises(ValueError):
        RangeSet.from_ranges([[0, 5], [3, 7]])


def test_cursor_never_repeats_and_requeues_lowest_first():
    c = RolloutCursor(RangeSet.from_ranges([[0, 3], [5, 6]]))
    got = [c.next() for _ in range(4)]
    assert got == [3, 4, 6, 7]
    c.finish(3)
    c.requeue(6)
    c.requeue(4)
    c.requeue(3)  # finished: requeue is a no-op
    assert [c.next(), c.next(), c.next()] == [4, 6, 8]
    assert c.in_flight == {4, 6, 7, 8}


def test_journal_roundtrip_rotation_and_torn_tail(tmp_path):
    j = Journal(tmp_path)
    j.append(0, _traj("a"))
    j.append(1, _traj("b"))
    seg = j.rotate()
    j.append(2, _traj("c"))
    j.close()
    # a crash mid-write leaves a torn last line: it is dropped, the rest is read
    last = sorted(tmp_path.glob("seg-*.jsonl"))[-1]
    with open(last, "a") as f:
        f.write('{"rid": 3, "traj": {"token_ids": [1, 2')
    j2 = Journal(tmp_path)
    assert [rid for rid, _ in j2.read_from(0)] == [0, 1, 2]
    after = j2.read_from(seg)
    assert [(rid, t.task_id) for rid, t in after] == [(2, "c")]
    assert after[0][1] == _traj("c")
    j2.prune_before(seg)
    assert [rid for rid, _ in j2.read_from(0)] == [2]
    # a reopened journal appends to a fresh segment, never into a torn one
    j2.append(4, _traj("d"))
    j2.close()
    assert [rid for rid, _ in Journal(tmp_path).read_from(0)] == [2, 4]
