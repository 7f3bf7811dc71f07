"""Small in-process metrics: latency histograms with fixed buckets, mergeable across actors."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from cmx.stats import LatencyStats

__all__ = ["LATENCY_BUCKETS_S", "Histogram"]

# Upper bounds in seconds, Prometheus style (+Inf is implied).
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)  # one per bucket, plus +Inf
    total: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.total += value
            self.count += 1

    def snapshot(self) -> LatencyStats:
        with self._lock:
            return LatencyStats(tuple(self.buckets), tuple(self.counts), self.total, self.count)
