"""/metrics in the Prometheus text format, and the same figures through ray.util.metrics."""

from __future__ import annotations

from typing import Any

from api_fakes import NODE_A, NODE_B, FakeBackend, admin
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cmx.api.app import create_app
from cmx.api.figures import CATALOGUE, Kind, figures
from cmx.api.ray_metrics import RayMetricsMirror
from cmx.api.stats_samples import Sample
from cmx.api.views import pool_view, tiers_view
from cmx.tiers import Tier


def scrape(backend: FakeBackend) -> dict[str, Any]:
    app = create_app(lambda: backend, admin(), sample_in_background=False)
    with TestClient(app) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_metrics_parse_and_carry_tiers_moves_latency_and_queues() -> None:
    backend = FakeBackend()
    backend.put(b"k" * 32, NODE_A, Tier.DRAM)
    backend.tiers[(NODE_A, Tier.DRAM)].hits = 3
    backend.tiers[(NODE_A, Tier.DRAM)].misses = 1
    for seconds in (0.0004, 0.003, 0.003, 20.0):
        backend.latency.observe(seconds)
    families = scrape(backend)
    assert all(name.startswith("cmx_") for name in families)

    def value(name: str, suffix: str = "", **labels: str) -> float:
        for s in families[name].samples:
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        raise AssertionError(f"{name}{suffix} {labels} not found")

    assert value("cmx_nodes") == 2
    assert value("cmx_tier_used_bytes", node=NODE_A, tier="dram") == 32 << 10
    assert value("cmx_tier_occupancy_ratio", node=NODE_A, tier="dram") == 1 / 16
    assert value("cmx_tier_hit_ratio", node=NODE_A, tier="dram") == 0.75
    assert families["cmx_tier_hits"].type == "counter"
    assert value("cmx_tier_hits", "_total", node=NODE_A, tier="dram") == 3
    assert value("cmx_tier_emulated", node=NODE_B, tier="hbm") == 1
    assert value("cmx_moved_bytes", "_total", node=NODE_A, src="dram", dst="nvme") == 32 << 10
    assert value("cmx_agent_queue_depth", node=NODE_A, priority="demote") == 2
    assert value("cmx_component_up", node="", component="dir:1") == 0
    assert families["cmx_transfer_latency_seconds"].type == "histogram"
    lat = {"node": NODE_A, "op": "store"}
    assert value("cmx_transfer_latency_seconds", "_bucket", le="0.0005", **lat) == 1
    assert value("cmx_transfer_latency_seconds", "_bucket", le="0.005", **lat) == 3
    assert value("cmx_transfer_latency_seconds", "_bucket", le="+Inf", **lat) == 4
    assert value("cmx_transfer_latency_seconds", "_count", **lat) == 4
    assert value("cmx_pool_enabled") == 0


class FakeMetric:
    def __init__(self, kind: Kind, name: str, tags: tuple[str, ...],
                 bounds: tuple[float, ...]) -> None:
        self.kind, self.name, self.tags, self.bounds = kind, name, tags, bounds
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        self.observed: list[float] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values[tuple(sorted(tags.items()))] = value

    def inc(self, value: float, tags: dict[str, str]) -> None:
        key = tuple(sorted(tags.items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def observe(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tags)
        self.observed.append(value)


def test_ray_mirror_sets_gauges_adds_counter_deltas_and_replays_histograms() -> None:
    made: dict[str, FakeMetric] = {}

    def factory(kind: Kind, name: str, doc: str, tags: tuple[str, ...],
                bounds: tuple[float, ...]) -> FakeMetric:
        assert doc and name not in made
        made[name] = FakeMetric(kind, name, tags, bounds)
        return made[name]

    backend = FakeBackend()
    mirror = RayMetricsMirror(factory)

    def update() -> None:
        sample = Sample.of(0.0, backend.stats())
        mirror.update(figures(tiers_view(sample, None), pool_view(sample.stats.pool)))

    dram = backend.tiers[(NODE_A, Tier.DRAM)]
    dram.hits = 5
    backend.latency.observe(0.003)
    update()
    tags = (("node", NODE_A), ("tier", "dram"))
    assert made["cmx_tier_hits"].values[tags] == 5
    dram.hits = 7
    backend.latency.observe(0.003)
    backend.latency.observe(30.0)
    update()
    assert made["cmx_tier_hits"].values[tags] == 7  # 5, then 2 more
    dram.hits = 1  # the tier restarted: its new count is added
    update()
    assert made["cmx_tier_hits"].values[tags] == 8
    assert made["cmx_tier_capacity_bytes"].values[tags] == 16 * (32 << 10)
    # Both fake nodes report the same store histogram: 3 observations each, each replayed once,
    # in the middle of its bucket (+Inf: twice the last bound).
    lat = made["cmx_transfer_latency_seconds"]
    assert sorted(lat.observed) == [0.00375] * 4 + [20.0] * 2
    assert lat.bounds[0] == 0.0005


def test_every_figure_is_documented_and_prefixed() -> None:
    names = [f.name for f in CATALOGUE]
    assert len(names) == len(set(names))
    for fig in CATALOGUE:
        assert fig.name.startswith("cmx_") and fig.help.endswith(".")
        assert not fig.name.endswith("_total")
