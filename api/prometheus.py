"""``/metrics``: the figures in the Prometheus text exposition format, via prometheus_client."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cmx.api.figures import Figure, HistogramValue, Kind, scalar

__all__ = ["CONTENT_TYPE_LATEST", "render"]


def _family(fig: Figure) -> Metric:
    labels = list(fig.labels)
    if fig.kind is Kind.HISTOGRAM:
        hist = HistogramMetricFamily(fig.name, fig.help, labels=labels)
        for values, h in fig.samples:
            assert isinstance(h, HistogramValue)
            cumulative, running = [], 0
            for bound, count in zip((*h.buckets, float("inf")), h.counts):
                running += count
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
            hist.add_metric(list(values), cumulative, h.sum)
        return hist
    family = (CounterMetricFamily if fig.kind is Kind.COUNTER else GaugeMetricFamily)(
        fig.name, fig.help, labels=labels)
    for values, value in fig.samples:
        family.add_metric(list(values), scalar(value))
    return family


class _Figures(Collector):
    def __init__(self, figures: Iterable[Figure]) -> None:
        self._figures = list(figures)

    def collect(self) -> Iterator[Metric]:
        for fig in self._figures:
            yield _family(fig)


def render(figures: Iterable[Figure]) -> bytes:
    """The text exposition of ``figures`` (content type ``CONTENT_TYPE_LATEST``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures(figures))
    return generate_latest(registry)
