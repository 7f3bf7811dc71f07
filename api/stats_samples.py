"""Successive samples of the service's stats: recent bandwidth, interval hit ratio, history.

A tier reports counters since it started (bytes in and out, hits, misses). Rates come from two
samples of the same tier incarnation (same ``epoch``); a restart in between resets the counters,
so that interval has no rate rather than a negative one. Time is injected (``clock``), so tests
drive it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cmx.stats import ServiceStats, TierStats

__all__ = ["Rates", "Sample", "StatsSampler", "TierPoint", "rates_between"]

TierId = tuple[str, str]  # (node, tier)


@dataclass(frozen=True)
class TierPoint:
    """The counters of one tier in one sample."""

    epoch: str | None
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int

    @classmethod
    def of(cls, stats: TierStats) -> TierPoint:
        s = stats.store
        return cls(stats.epoch, s.capacity_bytes, s.used_bytes, s.hits, s.misses,
                   s.bytes_written, s.bytes_read)


@dataclass(frozen=True)
class Sample:
    t: float  # clock time of the sample (Unix seconds with the default clock)
    stats: ServiceStats  # what Backend.stats() answered
    tiers: dict[TierId, TierPoint]  # the tiers that answered

    @classmethod
    def of(cls, t: float, stats: ServiceStats) -> Sample:
        tiers = {(node, tier.value): TierPoint.of(s) for node, entry in stats.nodes.items()
                 for tier, s in entry.tiers.items() if isinstance(s, TierStats)}
        return cls(t, stats, tiers)


@dataclass(frozen=True)
class Rates:
    window_s: float
    in_bytes_per_s: float
    out_bytes_per_s: float
    hit_ratio: float | None  # hits / lookups within the window; None: no lookups


def rates_between(before: Sample, after: Sample, tier: TierId) -> Rates | None:
    """Rates of ``tier`` from ``before`` to ``after``; None if not comparable."""
    a, b = before.tiers.get(tier), after.tiers.get(tier)
    dt = after.t - before.t
    if a is None or b is None or dt <= 0 or a.epoch != b.epoch:
        return None
    deltas = (b.bytes_in - a.bytes_in, b.bytes_out - a.bytes_out, b.hits - a.hits,
              b.misses - a.misses)
    if min(deltas) < 0:  # counters went back: the tier restarted without a new epoch
        return None
    d_in, d_out, d_hits, d_misses = deltas
    lookups = d_hits + d_misses
    return Rates(dt, d_in / dt, d_out / dt, d_hits / lookups if lookups else None)


class StatsSampler:
    """Keeps the samples of the last ``history_s`` seconds; thread-safe."""

    def __init__(
        self, collect: Callable[[], ServiceStats], history_s: float = 900.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._collect = collect
        self.history_s = history_s
        self._clock = clock
        self._samples: deque[Sample] = deque()
        self._lock = threading.Lock()
        self._collecting = threading.Lock()  # one collection at a time

    def sample(self) -> Sample:
        """Collect now and remember it."""
        with self._collecting:
            stats = self._collect()
            s = Sample.of(self._clock(), stats)
            with self._lock:
                self._samples.append(s)
                while self._samples and s.t - self._samples[0].t > self.history_s:
                    self._samples.popleft()
            return s

    def fresh(self, max_age_s: float) -> Sample:
        """The latest sample if younger than ``max_age_s``, else a new one."""
        with self._lock:
            latest = self._samples[-1] if self._samples else None
        if latest is not None and self._clock() - latest.t < max_age_s:
            return latest
        return self.sample()

    def previous(self, sample: Sample) -> Sample | None:
        """The sample before ``sample``, if still remembered."""
        with self._lock:
            earlier = [s for s in self._samples if s.t < sample.t]
        return earlier[-1] if earlier else None

    def window(self, seconds: float) -> list[Sample]:
        with self._lock:
            if not self._samples:
                return []
            end = self._samples[-1].t
            return [s for s in self._samples if end - s.t <= seconds]

    def __iter__(self) -> Iterator[Sample]:
        with self._lock:
            return iter(list(self._samples))

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)
