"""``cmx demo``'s tables fit an 80-column terminal with every column."""

from __future__ import annotations

from rich.console import Console

from cmx.deploy.demo import LLMDemoResult, RequestRow
from cmx.deploy.render import print_llm_demo
from cmx.stats import (
    AgentStats,
    LeaseStats,
    NodeStats,
    PoolStats,
    QueueStats,
    ServiceStats,
    TierStats,
    TransportStats,
    Unreachable,
)
from cmx.storage.base import StoreStats
from cmx.storage.nvme.dataplane import PlaneStats
from cmx.tiers import Tier

MiB = 1 << 20


def test_the_demo_report_fits_80_columns() -> None:
    rows = [
        RequestRow(1, 1, "doc A q1", "R1", 2910, 0, 0, "none", 3.3, 3.2, True, False),
        RequestRow(2, 2, "doc A q2", "R2", 2932, 2816, 2816, "done", 0.4, 3.0, True, False),
        RequestRow(3, 6, "chat X t3", "R2", 1958, 1280, 0, "none", 2.1, 1.9, False, True),
    ]
    store = StoreStats(256 * MiB, MiB, 1, hits=2)
    leases = LeaseStats(0, 0, 0, 0)
    tiers = {Tier.HBM: TierStats(Tier.HBM, "n1", "e", store, 0, 0, leases, emulated=True),
             Tier.DRAM: TierStats(Tier.DRAM, "n1", "e", store, 0, 0, leases),
             Tier.NVME: Unreachable("cmx:nvme:n1 did not answer")}
    agent = AgentStats(
        agent="a1", node="n1", placed_on="n1", transport="nixl-ucx",
        moved_bytes={"dram@peer->hbm": 27 * MiB}, moved_via={"nixl-ucx": 27 * MiB},
        dropped_blocks={}, corrupt_blocks={}, latency={},
        queues=QueueStats({}, {}, 0, 0), transport_stats=TransportStats(),
        plane=PlaneStats("pwritev", 16, True, 0, 0, 0, 0, 0))
    stats = ServiceStats({"n1": NodeStats("n1", tiers, agent)}, (), PoolStats({}, 1, 0, 0))
    result = LLMDemoResult(rows, {"R1": "head", "R2": "worker"}, stats, {"n1": "head"},
                           "SmolLM2-135M-Instruct", 40.0, 60.0)
    console = Console(width=80, record=True)
    print_llm_demo(console, result)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for header in ("request", "prompt", "cached", "memory", "TTFT", "no cache", "gain", "same"):
        assert header in text
    assert "2,816*" in text and "local" in text and "hbm (emulated)" in text
    assert "27.0 MiB of KV moved between the nodes' agents" in " ".join(text.split())
    words = " ".join(text.split())
    assert "Model: SmolLM2-135M-Instruct" in words
    assert "Same output with and without the cache: 2/3" in words
    assert not result.ok
