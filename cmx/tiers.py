"""The storage tiers, fastest first.

A tier is a kind of memory, not a place: every node has its own DRAM and NVMe; the pool is
the cluster's shared remote NVMe.
"""

from __future__ import annotations

import enum

__all__ = ["Tier"]


class Tier(str, enum.Enum):
    HBM = "hbm"  # G1: GPU memory of a serving replica
    DRAM = "dram"  # G2: host memory arena of a node, shared with its offload agent
    NVME = "nvme"  # G3: local NVMe of a node
    POOL = "pool"  # G4: pooled remote NVMe, blocks placed by rendezvous hashing

    @property
    def rank(self) -> int:
        """0 for the fastest tier; a larger rank is slower and larger."""
        return _RANK[self]


_RANK = {tier: i for i, tier in enumerate(Tier)}
