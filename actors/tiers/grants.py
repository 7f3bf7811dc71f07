"""What a memory tier (``actors.tiers.arena.ArenaTierService``) hands its callers: a slot
granted for a write (with the block it must demote out of it first), and its arena's info."""

from __future__ import annotations

from dataclasses import dataclass

from cmx.keys import BlockHash
from cmx.tiers import Tier

__all__ = ["ArenaInfo", "Grant", "Victim"]


@dataclass(frozen=True)
class Victim:
    key: BlockHash
    size: int
    checksum: int | None
    parent: BlockHash | None
    namespace: str = ""  # its namespace id, carried to the tier it is demoted to


@dataclass(frozen=True)
class Grant:
    key: BlockHash
    slot: int
    epoch: str  # of the tier that granted it: a restarted tier has a new arena
    lease: int  # commit or abort by it
    victim: Victim | None = None  # demote it out of ``slot`` before writing


@dataclass(frozen=True)
class ArenaInfo:
    tier: Tier
    node: str
    arena: str  # shared-memory name the agent attaches
    slot_bytes: int
    num_slots: int
    emulated: bool  # an HBM tier on host memory (no GPU)
    epoch: str
