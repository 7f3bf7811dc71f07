"""The same figures through ``ray.util.metrics``, so Ray's dashboard and its Prometheus scrape them.

Ray exports them with its ``ray_`` prefix (``ray_cmx_tier_used_bytes``). Gauges are set; counters
and histograms are cumulative in the service, so each update adds what changed since the last
one (a count that went back means its actor restarted: its new total is added). A histogram's
new observations are replayed at the middle of their bucket, so Ray's bucket counts match the
agent's; its sum is approximate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cmx.api.figures import Figure, HistogramValue, Kind, scalar

__all__ = ["MAX_REPLAY", "RayMetricsMirror", "ray_factory"]

MAX_REPLAY = 10_000  # observations replayed per bucket and update; beyond it counts are clipped

Factory = Callable[[Kind, str, str, tuple[str, ...], tuple[float, ...]], Any]


def ray_factory(kind: Kind, name: str, doc: str, tag_keys: tuple[str, ...],
                boundaries: tuple[float, ...]) -> Any:
    from ray.util import metrics

    if kind is Kind.GAUGE:
        return metrics.Gauge(name, doc, tag_keys=tag_keys)
    if kind is Kind.COUNTER:
        return metrics.Counter(name, doc, tag_keys=tag_keys)
    return metrics.Histogram(name, doc, boundaries=list(boundaries), tag_keys=tag_keys)


def _midpoints(buckets: tuple[float, ...]) -> list[float]:
    """A value strictly inside each bucket, the last (+Inf) included."""
    lows = (0.0, *buckets)
    mids = [(lo + hi) / 2 for lo, hi in zip(lows, buckets)]
    return [*mids, (buckets[-1] * 2) if buckets else 1.0]


class RayMetricsMirror:
    def __init__(self, factory: Factory = ray_factory) -> None:
        self._factory = factory
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[str, ...]], Any] = {}

    def update(self, figures: Iterable[Figure]) -> None:
        for fig in figures:
            for values, value in fig.samples:
                metric = self._metric(fig, value)
                tags = dict(zip(fig.labels, values))
                if fig.kind is Kind.GAUGE:
                    metric.set(scalar(value), tags)
                elif fig.kind is Kind.COUNTER:
                    self._count(metric, fig.name, values, scalar(value), tags)
                elif isinstance(value, HistogramValue):
                    self._replay(metric, fig.name, values, value, tags)

    def _metric(self, fig: Figure, value: object) -> Any:
        metric = self._metrics.get(fig.name)
        if metric is None:
            bounds = value.buckets if isinstance(value, HistogramValue) else ()
            metric = self._factory(fig.kind, fig.name, fig.help, fig.labels, bounds)
            self._metrics[fig.name] = metric
        return metric

    def _count(self, metric: Any, name: str, values: tuple[str, ...], total: float,
               tags: dict[str, str]) -> None:
        last = self._last.get((name, values), 0.0)
        self._last[(name, values)] = total
        delta = total - last if total >= last else total
        if delta > 0:
            metric.inc(delta, tags)

    def _replay(self, metric: Any, name: str, values: tuple[str, ...], h: HistogramValue,
                tags: dict[str, str]) -> None:
        last = self._last.get((name, values))
        self._last[(name, values)] = h.counts
        if last is None or len(last) != len(h.counts) or any(
                b < a for a, b in zip(last, h.counts)):
            last = (0,) * len(h.counts)
        for mid, before, now in zip(_midpoints(h.buckets), last, h.counts):
            for _ in range(min(now - before, MAX_REPLAY)):
                metric.observe(mid, tags)
