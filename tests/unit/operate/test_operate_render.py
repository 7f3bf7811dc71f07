"""`cmx status` says what needs an operator: the node's store, orphans, fallbacks in force."""

from __future__ import annotations

from rich.console import Console

from cmx.operate.render import status_tables


def _tier(name: str, **extra: object) -> dict[str, object]:
    return {"tier": name, "available": True, "capacity_bytes": 1 << 20, "used_bytes": 0,
            "blocks": 0, "extra": extra}


def test_status_names_the_store_its_orphans_and_each_fallback() -> None:
    view = {"nodes": [{
        "node": "abcdef0123456789",
        "agent": {"available": True, "transport": "ray", "queues": {},
                  "degraded": "object_store_transport: NIXL did not start: no plugins"},
        "tiers": [_tier("hbm"), _tier("dram"),
                  _tier("nvme", store_id="4f1c2a", orphan_dirs=2, orphan_bytes=3 << 20,
                        degraded="buffered_io: /mnt/x refuses O_DIRECT")],
    }]}
    console = Console(width=200, record=True)
    for table in status_tables(view):
        console.print(table)
    text = console.export_text()
    assert "agent: DEGRADED, object_store_transport: NIXL did not start" in text
    assert "NVMe G3: DEGRADED, buffered_io: /mnt/x refuses O_DIRECT" in text
    assert "NVMe G3: store node-4f1c2a" in text
    assert "2 orphaned store dir(s), 3.0 MiB (`cmx orphans --collect`)" in text
