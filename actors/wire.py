"""Messages between data planes (offload agents and pool nodes): what is pinned where."""

from __future__ import annotations

from dataclasses import dataclass

from cmx.keys import BlockHash
from cmx.tiers import Tier

__all__ = ["LoadResult", "Loaded", "Offer", "Staged"]


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
    lease: int = 0  # of the pin on the peer: ``unstage`` ends it


@dataclass(frozen=True)
class Offer:
    """A block pinned in the offering node's arena, for a pool node to pull."""

    key: BlockHash
    parent: BlockHash | None
    region: str
    slot: int
    size: int
    checksum: int


@dataclass(frozen=True)
class Loaded:
    """A block now pinned in this node's HBM arena, and where it came from."""

    key: BlockHash
    slot: int
    size: int
    source_tier: Tier
    source_node: str
    via: str  # "local", "nvme", or the transport's name
    checksum: int = 0  # of the payload: the reader checks it before using the bytes
    lease: int = 0  # of the HBM pin: end it with ``release``


@dataclass(frozen=True)
class LoadResult:
    arena: str  # the HBM arena the slots are in ("" if it is gone: nothing was loaded)
    blocks: list[Loaded]  # the loaded prefix, pinned until ``release`` or the lease expires
