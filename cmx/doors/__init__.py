"""Typed calls between the service's actors: one frozen request per method
(``cmx.doors.base``), grouped by who answers them: the tiers (``tiers``), the agent and
peers (``agent``), the directory, the controller and pool nodes (``directory``)."""

from __future__ import annotations

from cmx.doors.agent import (
    AgentStatsOf,
    CommitStore,
    ExposeSelection,
    GiveUp,
    GrantStore,
    Load,
    LoadSlices,
    MoveExtents,
    PeerInfoOf,
    Prefetch,
    QuarantineCopies,
    QuarantineStaged,
    ReadSelection,
    ReadSlots,
    Release,
    ReleaseSelection,
    Stage,
    Unstage,
)
from cmx.doors.base import Pending, Request
from cmx.doors.directory import (
    Apply,
    Checksums,
    DropSource,
    DropStaging,
    FindCopies,
    Ingest,
    Lookup,
    NamespaceBlocks,
    Nodes,
    PoolMembers,
    PoolReplicas,
    Resync,
    ShardStatsOf,
)
from cmx.doors.tiers import (
    Abort,
    Acquire,
    ArenaInfoOf,
    Commit,
    CommitExtents,
    CommitPinned,
    Contains,
    Evict,
    Held,
    Pin,
    PinColumns,
    PinExtents,
    PinFor,
    QuarantineExtents,
    QuarantineKeys,
    QuarantinePinned,
    ReleaseOwner,
    ReserveExtents,
    ReserveSlots,
    TierStatsOf,
    Unpin,
)

__all__ = [
    "Abort", "Acquire", "AgentStatsOf", "Apply", "ArenaInfoOf", "Checksums", "Commit",
    "CommitExtents", "CommitPinned", "CommitStore", "Contains", "DropSource", "DropStaging",
    "Evict", "ExposeSelection", "FindCopies", "GiveUp", "GrantStore", "Held", "Ingest", "Load",
    "LoadSlices",
    "Lookup", "MoveExtents", "NamespaceBlocks", "Nodes", "PeerInfoOf", "Pending", "Pin",
    "PinColumns", "PinExtents", "PinFor", "PoolMembers", "PoolReplicas", "Prefetch",
    "QuarantineCopies",
    "QuarantineExtents", "QuarantineKeys", "QuarantinePinned", "QuarantineStaged", "ReadSelection",
    "ReadSlots", "Release", "ReleaseOwner", "ReleaseSelection", "Request", "ReserveExtents",
    "ReserveSlots", "Resync", "ShardStatsOf", "Stage", "TierStatsOf", "Unpin", "Unstage",
]
