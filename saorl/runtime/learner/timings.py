"""Seconds and call counts per label: what a trainer step measures of itself (``time/*``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Seconds and call counts per label, accumulated."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, label: str, dt: float) -> None:
        self.seconds[label] += dt
        self.calls[label] += 1

    @contextmanager
    def span(self, label: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(label, time.perf_counter() - t0)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
