"""Nothing lost: the rollout cursor and the trajectory journal.

Every rollout the run ever asks for has a **rollout id** ``rid = seq * group_size + g``: ``seq``
indexes the stream of training prompts (task ``seq % num_tasks``), ``g`` the member of its group
(always 0 for single-rollout SAO). The :class:`RolloutCursor` hands out rids in increasing order,
never one that is finished or in flight, and takes back the rids of a crashed worker.

Each finished trajectory is appended to the :class:`Journal` (one JSON line, flushed and fsynced)
the moment it reaches the trainer, before it is trained on. Every line carries the CRC-32 of its
own bytes (``{"rid": .., "traj": {..}, "crc": "1a2b3c4d"}``, the CRC over the line without its
``crc`` member), so damage is detected, never read as data: when a journal is read back, a last
line without its newline is a write cut short by a crash and is dropped (that rollout is sampled
again); any other line that fails its check stops the resume with :class:`CorruptionError`
naming the file and line. Segments are numbered without gaps (a rotation creates the next
segment at once), so a deleted segment is detected too. A checkpoint stores the set of
finished rids (compactly, as ranges) and the trajectories that were finished but not yet
trained; the journal is then rotated. After ``kill -9``, resume = checkpoint + journal segments
newer than it: the union gives the finished set (so nothing is dispatched twice) and the
untrained trajectories (trained on exactly once); every rid not finished is dispatched again, so
nothing in flight at the crash is skipped.
"""

from __future__ import annotations

import bisect
import heapq
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from saorl.data.trajectory import Trajectory
from saorl.runtime.rundir import CorruptionError

_CRC_TAIL = len(',"crc":"00000000"}')


class RangeSet:
    """A set of non-negative ints stored as sorted, disjoint half-open ranges ``[lo, hi)``."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        for lo, hi in ranges:
            for x in range(lo, hi):
                self.add(x)

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def __len__(self) -> int:
        return sum(h - lo for lo, h in zip(self._lo, self._hi))

    def __iter__(self) -> Iterator[int]:
        for lo, hi in zip(self._lo, self._hi):
            yield from range(lo, hi)

    def add(self, x: int) -> None:
        if x < 0:
            raise ValueError(f"RangeSet holds non-negative ints, got {x}")
        if x in self:
            return
        i = bisect.bisect_right(self._lo, x)  # ranges[:i] start at or before x
        joins_left = i > 0 and self._hi[i - 1] == x
        joins_right = i < len(self._lo) and self._lo[i] == x + 1
        if joins_left and joins_right:
            self._hi[i - 1] = self._hi[i]
            del self._lo[i], self._hi[i]
        elif joins_left:
            self._hi[i - 1] = x + 1
        elif joins_right:
            self._lo[i] = x
        else:
            self._lo.insert(i, x)
            self._hi.insert(i, x + 1)

    def ranges(self) -> list[list[int]]:
        return [[lo, hi] for lo, hi in zip(self._lo, self._hi)]

    @classmethod
    def from_ranges(cls, ranges: Iterable[Iterable[int]]) -> RangeSet:
        rs = cls()
        for lo, hi in ranges:
            if rs._lo and lo <= rs._hi[-1]:
                raise ValueError("ranges must be sorted and disjoint")
            rs._lo.append(int(lo))
            rs._hi.append(int(hi))
        return rs


class RolloutCursor:
    """Hands out rollout ids: the smallest one that is neither finished nor in flight."""

    def __init__(self, finished: RangeSet | None = None) -> None:
        self.finished = finished if finished is not None else RangeSet()
        self.in_flight: set[int] = set()
        self._requeued: list[int] = []
        self._frontier = 0

    def next(self) -> int:
        while self._requeued:
            rid = heapq.heappop(self._requeued)
            if rid not in self.finished and rid not in self.in_flight:
                self.in_flight.add(rid)
                return rid
        while self._frontier in self.finished or self._frontier in self.in_flight:
            self._frontier += 1
        rid = self._frontier
        self._frontier += 1
        self.in_flight.add(rid)
        return rid

    def finish(self, rid: int) -> None:
        self.in_flight.discard(rid)
        self.finished.add(rid)

    def requeue(self, rid: int) -> None:
        """A rollout that was dispatched but will never finish (its worker died)."""
        if rid in self.in_flight:
            self.in_flight.discard(rid)
            heapq.heappush(self._requeued, rid)


def encode_entry(traj: Trajectory) -> str:
    """One journal line (no newline): the entry's JSON (its rollout id, ``traj.episode.rid``, and the
    trajectory) with the CRC-32 of that JSON appended."""
    body = json.dumps({"rid": traj.episode.rid, "traj": traj.to_dict()}, separators=(",", ":"))
    return f'{body[:-1]},"crc":"{zlib.crc32(body.encode()):08x}"}}'


def write_entries(f, trajs: Iterable[Trajectory]) -> None:
    """Write one line per trajectory to the open text file ``f``, then flush and fsync it once: the
    journal's writer, which a checkpoint's ``pending.jsonl`` goes through too."""
    for traj in trajs:
        f.write(encode_entry(traj) + "\n")
    f.flush()
    os.fsync(f.fileno())


def decode_entry(line: str) -> Trajectory:
    """The trajectory of a journal line, its ``episode.rid`` the line's rollout id; ``ValueError``
    saying why when the line is damaged."""
    body, tail = line[:-_CRC_TAIL] + "}", line[-_CRC_TAIL:]
    if len(line) <= _CRC_TAIL or not (tail.startswith(',"crc":"') and tail.endswith('"}')):
        raise ValueError("no checksum at the end of the line")
    try:
        crc = int(tail[8:16], 16)
    except ValueError:
        raise ValueError("the checksum is not hexadecimal") from None
    if zlib.crc32(body.encode()) != crc:
        raise ValueError("the checksum does not match the line's bytes")
    try:
        d = json.loads(body)
        rid, traj = int(d["rid"]), Trajectory.from_dict(d["traj"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the checksum matches but the entry is not a trajectory ({e})") from None
    traj.episode.rid = rid  # the same, but the line's own id is what the journal promises
    return traj


_SEGMENT = re.compile(r"seg-\d{8}\.jsonl")


def _seg_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


class Journal:
    """Append-only, fsynced JSONL of finished trajectories, in segments rotated at checkpoints."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        segs = self.segments()
        self._seg_index = (_seg_number(segs[-1]) + 1) if segs else 0
        self._file = None
        self.torn: list[Path] = []
        """Segments whose torn last line the last :meth:`read_from` dropped."""

    def segments(self) -> list[Path]:
        """The segment files, in order (other names in the directory are not the journal's)."""
        return sorted(p for p in self.dir.glob("seg-*.jsonl") if _SEGMENT.fullmatch(p.name))

    def segment_path(self, index: int) -> Path:
        return self.dir / f"seg-{index:08d}.jsonl"

    def _open(self):
        if self._file is None:
            self._file = open(self.segment_path(self._seg_index), "a", encoding="utf-8")
        return self._file

    def append(self, traj: Trajectory) -> None:
        self.append_many([traj])

    def append_many(self, trajs: list[Trajectory]) -> None:
        """Write, flush and fsync once (group commit: one fsync per arrival batch); each line's
        rollout id is ``episode.rid``."""
        write_entries(self._open(), trajs)

    def rotate(self) -> int:
        """Start a new segment; return its index, which the checkpoint manifest stores. Both the
        segment ending and the one starting exist on disk afterwards (even if empty), so segment
        numbers have no gaps and a missing one is damage. Opening a journal creates nothing: a
        reader never hides a deleted newest segment behind a fresh empty one."""
        self._open().close()
        self._file = None
        self._seg_index += 1
        self._open()
        return self._seg_index

    def prune_before(self, segment_index: int) -> None:
        for seg in self.segments():
            if _seg_number(seg) < segment_index:
                seg.unlink(missing_ok=True)

    def first_missing(self, index: int, newest: int = 0) -> Path | None:
        """The first of segments ``index, index+1, ...`` up to the newest there (or ``newest``,
        when more are known to have existed) that is not there, or None: a checkpoint that
        continues from segment ``index`` needs all of them."""
        present = {_seg_number(p) for p in self.segments()}
        newest = max(present | {index, newest})
        return next((self.segment_path(i) for i in range(index, newest + 1) if i not in present), None)

    def next_present(self, path: Path) -> Path | None:
        """The first segment after ``path`` that is there (what made a missing ``path`` needed)."""
        return next((p for p in self.segments() if _seg_number(p) > _seg_number(path)), None)

    def read_from(self, segment_index: int) -> list[Trajectory]:
        """Entries of segments >= ``segment_index``. A torn last line (no newline: a crash hit
        mid-write) is dropped and its segment noted in :attr:`torn`; any other damaged line is a
        :class:`CorruptionError` naming the file and line."""
        out = []
        self.torn = []
        for seg in self.segments():
            if _seg_number(seg) < segment_index:
                continue
            out += self._read_segment(seg)
        return out

    def _read_segment(self, seg: Path) -> list[Trajectory]:
        if not seg.is_file():
            raise CorruptionError(
                f"journal segment {seg} is not a file (a directory or another kind of file has its name); "
                "the run wrote a file there, so this is damage. The run stops rather than guess at its "
                "rollouts: restore the file if you have a copy, or move the thing away and resume again "
                "(the rollouts it held are sampled again).")
        data = seg.read_bytes()
        lines = data.split(b"\n")
        if lines[-1]:  # no newline at the end: the last write was cut short
            self.torn.append(seg)
        out = []
        for n, raw in enumerate(lines[:-1], 1):
            try:
                out.append(decode_entry(raw.decode("utf-8")))
            except (UnicodeDecodeError, ValueError) as e:
                reason = "it is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e)
                raise CorruptionError(
                    f"journal {seg}, line {n} of {len(lines) - 1}, is damaged ({reason}); only a torn "
                    "last line can come from a crash, so this is disk or file damage. The run stops "
                    "rather than drop or guess at a trajectory. Restore the file if you have a copy; "
                    f"or delete that line (e.g. `sed -i '{n}d' {seg}`), or the whole segment if every "
                    "line is damaged, and resume again: the rollouts on deleted lines are sampled "
                    "again, nothing is trained twice.") from None
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

