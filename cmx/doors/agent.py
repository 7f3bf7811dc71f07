"""Requests to a node's offload agent (``actors.agent.core.OffloadAgent``), and those a pool
node answers the same way as an agent, being a peer that stages and exposes blocks
(``actors.pool.node.PoolNodeService``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cmx.doors.base import Request
from cmx.protocol import Priority

if TYPE_CHECKING:
    import numpy as np  # noqa: F401 - named in quoted answer types

    from cmx.actors.slices.expose import (
        ExposedSlice,
        Exposure,  # noqa: F401 - named in quoted answer types
    )
    from cmx.actors.tiers.arena import Grant
    from cmx.actors.transport.base import PeerInfo  # noqa: F401 - named in quoted answer types
    from cmx.keys import BlockHash
    from cmx.protocol import Copy, Loaded, LoadResult, Staged, StoreCommit  # noqa: F401 - named in quoted answer types
    from cmx.selection import (
        Runs,
        SlicedBlock,  # noqa: F401 - named in quoted answer types
    )
    from cmx.stats import AgentStats  # noqa: F401 - named in quoted answer types
    from cmx.storage.nvme.dataplane import Extent
    from cmx.tiers import Tier

__all__ = [
    "AgentStatsOf", "CommitStore", "ExposeSelection", "GiveUp", "GrantStore", "Load", "LoadSlices",
    "MoveExtents", "PeerInfoOf", "Prefetch", "QuarantineCopies", "QuarantineStaged",
    "ReadSelection", "ReadSlots", "Release", "ReleaseSelection", "Stage", "Unstage",
]

AGENT = ("cmx.actors.agent.core.OffloadAgent",)
PEER = (*AGENT, "cmx.actors.pool.node.PoolNodeService")


@dataclass(frozen=True)
class Load(Request["LoadResult"]):
    """Move each block from its best copy into this node's HBM and pin it for ``owner``
    (a lease per window); ``of_blocks`` is the whole load's length, so the agent tells a
    scan from a load that fits."""

    method = "load"
    served_by = AGENT
    keys: Sequence[BlockHash]
    copies: Sequence[Sequence[Copy]]
    priority: Priority = Priority.LOAD
    owner: str = ""
    namespace: str = ""
    of_blocks: int = 0


@dataclass(frozen=True)
class Release(Request[None]):
    """End a load's pins, with the copies its reader found corrupt."""

    method = "release"
    served_by = AGENT
    leases: Sequence[int]
    corrupt: Sequence[Loaded] = ()


@dataclass(frozen=True)
class GiveUp(Request[int]):
    """End every pin ``owner`` holds now or is granted later; how many."""

    method = "give_up"
    served_by = AGENT
    owner: str


@dataclass(frozen=True)
class Prefetch(Request[int]):
    """Move blocks toward this node's HBM at prefetch priority; how many moved."""

    method = "prefetch"
    served_by = AGENT
    keys: Sequence[BlockHash]
    copies: Sequence[Sequence[Copy]]
    namespace: str = ""


@dataclass(frozen=True)
class GrantStore(Request["list[Grant | None]"]):
    """DRAM slots for a client to copy new blocks into, leased to ``owner``."""

    method = "grant_store"
    served_by = AGENT
    keys: Sequence[BlockHash]
    parents: Sequence[BlockHash | None]
    owner: str


@dataclass(frozen=True)
class CommitStore(Request["StoreCommit"]):
    """Commit the slots a client wrote, each (grant, size, checksum), and place copies."""

    method = "commit_store"
    served_by = AGENT
    keys: Sequence[BlockHash]
    parents: Sequence[BlockHash | None]
    done: Sequence[tuple[Grant, int, int]]
    namespace: str = ""
    replicas: int | None = None
    owner: str = ""


@dataclass(frozen=True)
class MoveExtents(Request["list[bool | None]"]):
    """Copy NVMe extents (source, target) for the tier's compaction."""

    method = "move_extents"
    served_by = AGENT
    pairs: Sequence[tuple[Extent, Extent]]


@dataclass(frozen=True)
class Stage(Request["list[Staged | None]"]):
    """Stage blocks in memory for a peer's pull, leased to ``owner``."""

    method = "stage"
    served_by = PEER
    keys: Sequence[BlockHash]
    owner: str


@dataclass(frozen=True)
class Unstage(Request[None]):
    """Let staged blocks go: the peer has pulled them."""

    method = "unstage"
    served_by = PEER
    staged: Sequence[Staged]


@dataclass(frozen=True)
class QuarantineStaged(Request[None]):
    """Drop the source copies of staged blocks the peer found corrupt."""

    method = "quarantine_staged"
    served_by = PEER
    staged: Sequence[Staged]


@dataclass(frozen=True)
class QuarantineCopies(Request[None]):
    """Drop this node's (or pool node's) copies of ``keys`` in ``tier``, found corrupt."""

    method = "quarantine_copies"
    served_by = PEER
    keys: Sequence[BlockHash]
    tier: Tier


@dataclass(frozen=True)
class PeerInfoOf(Request["PeerInfo"]):
    """How a peer reaches this node's memory: its transport's name and metadata."""

    method = "peer_info"
    served_by = PEER


@dataclass(frozen=True)
class ReadSlots(Request["list[np.ndarray]"]):
    """The bytes of staged slots (arena, slot), by value: the transport of last resort."""

    method = "read_slots"
    served_by = PEER
    slots: Sequence[tuple[str, int]]


@dataclass(frozen=True)
class LoadSlices(Request["list[SlicedBlock]"]):
    """The runs ``runs`` of each block's best copy, by value, verified at their source."""

    method = "load_slices"
    served_by = AGENT
    keys: Sequence[BlockHash]
    copies: Sequence[Sequence[Copy]]
    runs: Runs


@dataclass(frozen=True)
class ReadSelection(Request["list[SlicedBlock | None]"]):
    """A peer's runs of its blocks, by value."""

    method = "read_selection"
    served_by = PEER
    keys: Sequence[BlockHash]
    runs: Runs


@dataclass(frozen=True)
class ExposeSelection(Request["Exposure"]):
    """Expose a peer's runs of its blocks for a pull, leased to ``owner``."""

    method = "expose_selection"
    served_by = PEER
    keys: Sequence[BlockHash]
    runs: Runs
    owner: str


@dataclass(frozen=True)
class ReleaseSelection(Request[None]):
    """Let selections a peer exposed go: they were pulled."""

    method = "release_selection"
    served_by = PEER
    exposed: Sequence[ExposedSlice]


@dataclass(frozen=True)
class AgentStatsOf(Request["AgentStats"]):
    """The agent's figures: its queues, moves and transport."""

    method = "stats"
    served_by = AGENT
