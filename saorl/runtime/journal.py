"""Nothing lost: the rollout cursor and the trajectory journal.

Every rollout the run ever asks for has a **rollout id** ``rid = seq * group_size + g``: ``seq``
indexes the stream of training prompts (task ``seq % num_tasks``), ``g`` the member of its group
(always 0 for single-rollout SAO). The :class:`RolloutCursor` hands out rids in increasing order,
never one that is finished or in flight, and takes back the rids of a crashed worker.

Each finished trajectory is appended to the :class:`Journal` (one JSON line, flushed and fsynced)
the moment it reaches the trainer, before it is trained on. A checkpoint stores the set of
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
from collections.abc import Iterable, Iterator
from pathlib import Path

from saorl.data.trajectory import Trajectory


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


class Journal:
    """Append-only, fsynced JSONL of finished trajectories, in segments rotated at checkpoints."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        segs = self.segments()
        self._seg_index = (int(segs[-1].stem.split("-")[1]) + 1) if segs else 0
        self._file = None

    def segments(self) -> list[Path]:
        return sorted(self.dir.glob("seg-*.jsonl"))

    def _open(self):
        if self._file is None:
            path = self.dir / f"seg-{self._seg_index:08d}.jsonl"
            self._file = open(path, "a", encoding="utf-8")
        return self._file

    def append(self, rid: int, traj: Trajectory) -> None:
        self.append_many([(rid, traj)])

    def append_many(self, entries: list[tuple[int, Trajectory]]) -> None:
        """Write, flush and fsync once (group commit: one fsync per arrival batch)."""
        f = self._open()
        for rid, traj in entries:
            f.write(json.dumps({"rid": rid, "traj": traj.to_dict()}, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def rotate(self) -> int:
        """Start a new segment; return its index (stored in the checkpoint manifest)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._seg_index += 1
        return self._seg_index

    def prune_before(self, segment_index: int) -> None:
        for seg in self.segments():
            if int(seg.stem.split("-")[1]) < segment_index:
                seg.unlink(missing_ok=True)

    def read_from(self, segment_index: int) -> list[tuple[int, Trajectory]]:
        """Entries of segments >= ``segment_index``; a torn last line (kill -9) is dropped."""
        out = []
        for seg in self.segments():
            if int(seg.stem.split("-")[1]) < segment_index:
                continue
            with open(seg, encoding="utf-8") as f:
                for line in f:
                    try:
                        d = json.loads(line)
                        out.append((int(d["rid"]), Trajectory.from_dict(d["traj"])))
                    except (json.JSONDecodeError, KeyError, ValueError):
                        continue  # only a line cut short by a crash can fail here
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
