"""Single-node block stores: DRAM (shared-memory arena) and NVMe (log-structured, O_DIRECT).

The stores load on first use, so importing one (``cmx.storage.dram``) never pulls in the other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cmx.storage.base import BlockStore, EventKind, StoreEvent, StoreStats

if TYPE_CHECKING:
    from cmx.storage.dram import DramStore
    from cmx.storage.nvme import NvmeStore

__all__ = ["BlockStore", "DramStore", "EventKind", "NvmeStore", "StoreEvent", "StoreStats"]

_LAZY = {"DramStore": "cmx.storage.dram", "NvmeStore": "cmx.storage.nvme"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
