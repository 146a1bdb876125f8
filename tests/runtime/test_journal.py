import itertools
import json
import random
import zlib

import pytest

from saorl.data.trajectory import Trajectory
from saorl.runtime.journal import Journal, RangeSet, RolloutCursor, decode_entry, encode_entry
from saorl.runtime.rundir import CorruptionError


def _traj(tid: str, rid: int = -1) -> Trajectory:
    t = Trajectory(token_ids=[5, 6, 7], action_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.5, -1.25],
                   rewards=[0.0, 0.0, 1.0], versions=[-1, 3, 4], prompt_len=1, task_id=tid)
    t.episode.rid = rid
    return t


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
    j.append(_traj("a", 0))
    j.append(_traj("b", 1))
    seg = j.rotate()
    j.append(_traj("c", 2))
    j.close()
    # a crash mid-write leaves a torn last line: it is dropped, the rest is read
    last = sorted(tmp_path.glob("seg-*.jsonl"))[-1]
    with open(last, "a") as f:
        f.write('{"rid": 3, "traj": {"token_ids": [1, 2')
    j2 = Journal(tmp_path)
    assert [t.episode.rid for t in j2.read_from(0)] == [0, 1, 2]
    after = j2.read_from(seg)
    assert [(t.episode.rid, t.task_id) for t in after] == [(2, "c")]
    assert after[0] == _traj("c", 2)
    assert [p.name for p in j2.torn] == [last.name]
    j2.prune_before(seg)
    assert [t.episode.rid for t in j2.read_from(0)] == [2]
    # a reopened journal appends to a fresh segment, never into a torn one
    j2.append(_traj("d", 4))
    j2.close()
    assert [t.episode.rid for t in Journal(tmp_path).read_from(0)] == [2, 4]


def test_each_line_carries_the_crc_of_its_own_bytes():
    line = encode_entry(_traj("a", 7))
    d = json.loads(line)
    body = json.dumps({"rid": 7, "traj": _traj("a", 7).to_dict()}, separators=(",", ":"))
    assert d["crc"] == f"{zlib.crc32(body.encode()):08x}" and d["rid"] == 7
    assert decode_entry(line) == _traj("a", 7)
    flipped = line.replace('"task_id":"a"', '"task_id":"b"')
    with pytest.raises(ValueError, match="checksum does not match"):
        decode_entry(flipped)
    with pytest.raises(ValueError, match="no checksum"):
        decode_entry('{"rid":7,"traj":{}}')


def _three_lines(tmp_path):
    j = Journal(tmp_path)
    j.append_many([_traj("a", 0), _traj("b", 1), _traj("c", 2)])
    j.close()
    return sorted(tmp_path.glob("seg-*.jsonl"))[0]


@pytest.mark.parametrize("damage", ["flip", "garbage", "binary", "bad_last_line_with_newline"])
def test_damage_anywhere_but_a_torn_tail_stops_naming_file_and_line(tmp_path, damage):
    seg = _three_lines(tmp_path)
    lines = seg.read_bytes().split(b"\n")[:-1]
    if damage == "flip":  # one character of the middle line
        lines[1] = lines[1].replace(b'"task_id":"b"', b'"task_id":"x"')
        where = "line 2 of 3"
    elif damage == "garbage":
        lines[1] = b'{"rid": 1, "hello": [1, 2, 3]}'
        where = "line 2 of 3"
    elif damage == "binary":
        lines = [bytes(range(11, 256))] * 3  # no newline byte in it
        where = "line 1 of 3"
    else:
        lines[2] = lines[2][:40]  # cut short, yet followed by a newline: not what a crash leaves
        where = "line 3 of 3"
    seg.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(CorruptionError) as e:
        Journal(tmp_path).read_from(0)
    msg = str(e.value)
    assert str(seg) in msg and where in msg and "sed -i" in msg and "\n" not in msg


def test_first_missing_finds_a_deleted_segment(tmp_path):
    j = Journal(tmp_path)
    assert not list(tmp_path.iterdir())  # opening creates nothing
    assert j.rotate() == 1 and j.rotate() == 2  # both ends of a rotation exist, even when empty
    j.close()
    assert [p.name for p in Journal(tmp_path).segments()] == [f"seg-0000000{i}.jsonl" for i in range(3)]
    assert Journal(tmp_path).first_missing(1) is None
    (tmp_path / "seg-00000001.jsonl").unlink()
    assert Journal(tmp_path).first_missing(1).name == "seg-00000001.jsonl"
    assert Journal(tmp_path).first_missing(2) is None
    (tmp_path / "seg-00000002.jsonl").unlink()  # the newest: a new Journal must not hide it
    assert Journal(tmp_path).first_missing(2).name == "seg-00000002.jsonl"
