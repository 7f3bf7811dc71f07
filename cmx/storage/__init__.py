"""Single-node block stores: DRAM (shared-memory arena) and NVMe (log-structured, O_DIRECT)."""

from __future__ import annotations

from cmx.storage.base import BlockStore, EventKind, StoreEvent, StoreStats
from cmx.storage.dram import DramStore
from cmx.storage.nvme import NvmeStore

__all__ = ["BlockStore", "DramStore", "EventKind", "NvmeStore", "StoreEvent", "StoreStats"]
