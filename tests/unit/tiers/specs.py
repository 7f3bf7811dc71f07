"""Two tiers the service does not ship, each a spec and nothing else: registered (``conftest``),
the plane builds their books, the agent reads them, lookups rank them.

- ``CXL``: memory on a CXL expander, slower than DRAM and faster than NVMe: a shared-memory
  arena (``Holds.MEMORY``), pinned in place like DRAM.
- ``HDD``: a disk below NVMe: extents of segment files (``Holds.EXTENTS``), read and verified
  by the agent like NVMe, in a folder of its own.
"""

from __future__ import annotations

import os

from cmx.config import ServiceConfig
from cmx.tiers import Holds, Scope, TierSpec

__all__ = ["CXL", "HDD"]


def _cxl_bytes(config: ServiceConfig) -> int:
    return 2 * config.dram_bytes


def _hdd_bytes(config: ServiceConfig) -> int:
    return 4 * config.nvme_bytes


def _hdd_dir(config: ServiceConfig) -> str:
    return os.path.join(config.nvme_dir, "hdd")


CXL = TierSpec("cxl", 1.5, Holds.MEMORY, Scope.NODE, _cxl_bytes,
               link_here=(0.015, 1.5e9), link_peer=(0.040, 1.0e9))
HDD = TierSpec("hdd", 2.5, Holds.EXTENTS, Scope.NODE, _hdd_bytes,
               link_here=(0.040, 0.2e9), link_peer=(0.080, 0.15e9), files=_hdd_dir)
