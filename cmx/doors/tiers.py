"""Requests to a node's tier actors: the HBM and DRAM arena tiers
(``actors.tiers.arena.ArenaTierService``) and the NVMe tier's books
(``actors.tiers.nvme.NvmeTierService``). Where the two answer one method with different types
(a memory tier pins slots, NVMe pins extents), each answer has a request of its own."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cmx.doors.base import Request

if TYPE_CHECKING:
    from cmx.actors.tiers.arena import ArenaInfo, Grant  # noqa: F401 - named in quoted answer types
    from cmx.actors.tiers.nvme import Reserve
    from cmx.keys import BlockHash
    from cmx.protocol import Pinned, PinnedColumns  # noqa: F401 - named in quoted answer types
    from cmx.stats import TierStats  # noqa: F401 - named in quoted answer types
    from cmx.storage.nvme.dataplane import Extent

__all__ = [
    "Abort", "Acquire", "ArenaInfoOf", "Commit", "CommitExtents", "CommitPinned", "Contains",
    "Evict", "Held", "Pin", "PinColumns", "PinExtents", "PinFor", "QuarantineExtents",
    "QuarantineKeys",
    "QuarantinePinned", "ReleaseOwner", "ReserveExtents", "ReserveSlots", "TierStatsOf", "Unpin",
]

ARENA = ("cmx.actors.tiers.arena.ArenaTierService",)
NVME = ("cmx.actors.tiers.nvme.NvmeTierService",)
EVERY_TIER = ARENA + NVME


@dataclass(frozen=True)
class ArenaInfoOf(Request["ArenaInfo"]):
    """A memory tier's arena: its shared-memory name, slots and epoch."""

    method = "info"
    served_by = ARENA


@dataclass(frozen=True)
class ReserveSlots(Request["list[Grant | None]"]):
    """A slot for each (key, parent), leased to ``owner`` until committed or aborted."""

    method = "reserve"
    served_by = ARENA
    items: Sequence[tuple[BlockHash, BlockHash | None]]
    owner: str


@dataclass(frozen=True)
class ReserveExtents(Request["list[Extent | None]"]):
    """Room on NVMe for each (key, parent, size[, namespace]), leased to ``owner``."""

    method = "reserve"
    served_by = NVME
    items: Sequence[Reserve]
    owner: str


@dataclass(frozen=True)
class Commit(Request[int]):
    """Commit written slots, each (lease, size, checksum); how many were committed."""

    method = "commit"
    served_by = ARENA
    items: Sequence[tuple[int, int, int | None]]
    namespace: str = ""
    wait: bool = True


@dataclass(frozen=True)
class CommitExtents(Request[int]):
    """Commit written extents, each (lease, size, checksum, parent); how many were."""

    method = "commit"
    served_by = NVME
    items: Sequence[tuple[int, int, int, bytes]]


@dataclass(frozen=True)
class CommitPinned(Request["list[Pinned | None]"]):
    """``Commit``, then a pin for ``owner`` of each block committed, in one round trip."""

    method = "commit_pinned"
    served_by = ARENA
    items: Sequence[tuple[int, int, int]]
    namespace: str = ""
    wait: bool = True
    owner: str = ""
    listed: bool = True  # False: never published to the directory (a scan's window)


@dataclass(frozen=True)
class Abort(Request[None]):
    """Give back reservations that will not be written."""

    method = "abort"
    served_by = EVERY_TIER
    leases: Sequence[int]


@dataclass(frozen=True)
class Pin(Request["list[Pinned | None]"]):
    """Pin each committed key held in a memory tier for ``owner``."""

    method = "pin"
    served_by = ARENA
    keys: Sequence[bytes]
    owner: str


@dataclass(frozen=True)
class PinColumns(Request["PinnedColumns"]):
    """``Pin``, answered as columns (``PinnedColumns``): what a reader of a long prefix asks."""

    method = "pin_columns"
    served_by = ARENA
    keys: Sequence[bytes]
    owner: str


@dataclass(frozen=True)
class Acquire(Request["list[Pinned | Grant | None]"]):
    """``Pin`` each (key, parent) held, ``ReserveSlots`` for each that is not: what a load
    asks of HBM first, in one round trip."""

    method = "acquire"
    served_by = ARENA
    items: Sequence[tuple[BlockHash, BlockHash | None]]
    owner: str


@dataclass(frozen=True)
class PinExtents(Request["list[Extent | None]"]):
    """Pin each committed key held on NVMe for ``owner``: its extent."""

    method = "pin"
    served_by = NVME
    keys: Sequence[BlockHash]
    owner: str


@dataclass(frozen=True)
class PinFor(Request[list[object]]):
    """Pin keys for ``ttl_s`` (the admin's pins): a pin or None per key."""

    method = "pin_for"
    served_by = EVERY_TIER
    keys: Sequence[BlockHash]
    ttl_s: float
    owner: str


@dataclass(frozen=True)
class Unpin(Request[None]):
    """End pins, by lease (or by key, for the admin's)."""

    method = "unpin"
    served_by = EVERY_TIER
    leases: Iterable[int | BlockHash]


@dataclass(frozen=True)
class ReleaseOwner(Request[int]):
    """End every lease ``owner`` holds; how many."""

    method = "release_owner"
    served_by = EVERY_TIER
    owner: str


@dataclass(frozen=True)
class QuarantineKeys(Request[int]):
    """Drop the copies of ``keys`` held now, found corrupt."""

    method = "quarantine"
    served_by = EVERY_TIER
    keys: Sequence[bytes]


@dataclass(frozen=True)
class QuarantinePinned(Request[int]):
    """Drop the copies these pins named, found corrupt by their reader."""

    method = "quarantine_pinned"
    served_by = ARENA
    pins: Sequence[Pinned]


@dataclass(frozen=True)
class QuarantineExtents(Request[int]):
    """Drop the NVMe copies at these extents, found corrupt by their reader."""

    method = "quarantine_extents"
    served_by = NVME
    extents: Sequence[Extent]


@dataclass(frozen=True)
class Contains(Request[list[bool]]):
    """Whether each key is held committed."""

    method = "contains"
    served_by = (*EVERY_TIER, "cmx.actors.pool.node.PoolNodeService")
    keys: Sequence[bytes]


@dataclass(frozen=True)
class Held(Request["list[tuple[int, int] | None]"]):
    """(size, checksum) of each key a memory tier holds committed, by its books."""

    method = "held"
    served_by = ARENA
    keys: Sequence[bytes]


@dataclass(frozen=True)
class Evict(Request[int]):
    """Drop the unpinned copies of ``keys``; how many went."""

    method = "evict"
    served_by = (*EVERY_TIER, "cmx.actors.pool.node.PoolNodeService")
    keys: Sequence[bytes]


@dataclass(frozen=True)
class TierStatsOf(Request["TierStats"]):
    """A tier's (or a pool node's) figures."""

    method = "stats"
    served_by = (*EVERY_TIER, "cmx.actors.pool.node.PoolNodeService")
