"""Messages between data planes (offload agents and pool nodes): what is pinned where."""

from __future__ import annotations

from dataclasses import dataclass

from cmx.keys import BlockHash
from cmx.tiers import Tier

__all__ = ["Offer", "Staged"]


@dataclass(frozen=True)
class Staged:
    """A block pinned in a memory arena of the peer's node for one transfer."""

    key: BlockHash
    tier: Tier
    region: str
    slot: int
    size: int
    checksum: int
    source_tier: Tier  # where it was before staging (NVMe blocks are promoted first)


@dataclass(frozen=True)
class Offer:
    """A block pinned in the offering node's arena, for a pool node to pull."""

    key: BlockHash
    parent: BlockHash | None
    region: str
    slot: int
    size: int
    checksum: int
