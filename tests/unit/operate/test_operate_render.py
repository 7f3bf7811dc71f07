"""`cmx status` says what needs an operator: the node's store, orphans, fallbacks in force."""

from __future__ import annotations

from rich.console import Console

from cmx.api.models import PoolStatus, TiersView
from cmx.operate.render import status_tables


def _tier(name: str, **extra: object) -> dict[str, object]:
    return {"node": "abcdef0123456789", "tier": name, "available": True,
            "capacity_bytes": 1 << 20, "used_bytes": 0, "blocks": 0, "extra": extra}


def test_status_names_the_store_its_orphans_and_each_fallback() -> None:
    view = TiersView.model_validate({"sampled_at": 0.0, "directory": [], "nodes": [{
        "node": "abcdef0123456789",
        "agent": {"available": True, "transport": "ray",
                  "degraded": "object_store_transport: NIXL did not start: no plugins"},
        "tiers": [_tier("hbm"), _tier("dram"),
                  _tier("nvme", store_id="4f1c2a", orphan_dirs=2, orphan_bytes=3 << 20,
                        degraded="buffered_io: /mnt/x refuses O_DIRECT")],
    }]})
    console = Console(width=200, record=True)
    for table in status_tables(view):
        console.print(table)
    text = console.export_text()
    assert "agent: DEGRADED, object_store_transport: NIXL did not start" in text
    assert "NVMe G3: DEGRADED, buffered_io: /mnt/x refuses O_DIRECT" in text
    assert "NVMe G3: store node-4f1c2a" in text
    assert "2 orphaned store dir(s), 3.0 MiB (`cmx orphans --collect`)" in text


def test_status_shows_a_pool_node_that_does_not_answer() -> None:
    pool = PoolStatus.model_validate({
        "enabled": True, "capacity_bytes": 4 << 20, "used_bytes": 1 << 20, "blocks": 2,
        "replication": 2, "nodes": [
            {"node": "p1aaaaaaaa", "capacity_bytes": 4 << 20, "used_bytes": 1 << 20,
             "blocks": 2},
            {"node": "p2bbbbbbbb", "available": False}]})
    console = Console(width=200, record=True)
    for table in status_tables(TiersView(sampled_at=0.0, nodes=[], directory=[]), pool):
        console.print(table)
    text = console.export_text()
    assert "2 pool node(s) · 2 cop(ies) per block" in text
    assert "p2bbbbbb" in text and "not answering" in text
    assert "1.0 MiB / 4.0 MiB" in text
