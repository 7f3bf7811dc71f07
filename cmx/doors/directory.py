"""Requests to the directory's shards (``actors.directory.shard.DirectoryShard``) and to the
controller that keeps the list of nodes and pool members (``actors.service.Controller``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cmx.doors.base import Request

if TYPE_CHECKING:
    from cmx.actors.directory.shard import (
        ApplyResult,  # noqa: F401 - named in quoted answer types
        Entry,
        Source,
    )
    from cmx.copy_table import CopyTable  # noqa: F401 - named in quoted answer types
    from cmx.protocol import (
        Copy,  # noqa: F401 - named in quoted answer types
        Offer,
    )
    from cmx.stats import DirectoryStats  # noqa: F401 - named in quoted answer types

__all__ = [
    "Apply", "Checksums", "DropSource", "DropStaging", "FindCopies", "Ingest", "Lookup",
    "NamespaceBlocks", "Nodes", "PoolMembers", "PoolReplicas", "Resync", "ShardStatsOf",
]

SHARD = ("cmx.actors.directory.shard.DirectoryShard",)
CONTROLLER = ("cmx.actors.service.Controller",)
POOL = ("cmx.actors.pool.node.PoolNodeService",)


@dataclass(frozen=True)
class Lookup(Request["list[list[Copy]]"]):
    """Every committed copy the shard knows of each key."""

    method = "lookup"
    served_by = SHARD
    keys: Sequence[bytes]


@dataclass(frozen=True)
class FindCopies(Request["CopyTable"]):
    """``Lookup`` of many keys at once: ``keys`` end to end in one buffer, the answer one
    table (``cmx.copy_table``), so neither side makes an object per key."""

    method = "find_copies"
    served_by = SHARD
    keys: bytes


@dataclass(frozen=True)
class NamespaceBlocks(Request["list[tuple[bytes, list[Copy]]]"]):
    """Every block of one namespace the shard knows, with its copies."""

    method = "namespace_blocks"
    served_by = SHARD
    namespace: str


@dataclass(frozen=True)
class Apply(Request["ApplyResult"]):
    """A source's next batch of store events (``seq`` numbers them without gaps)."""

    method = "apply"
    served_by = SHARD
    source: Source
    epoch: str
    seq: int
    entries: Sequence[Entry]


@dataclass(frozen=True)
class Resync(Request[None]):
    """A source's whole holdings for the shard, replacing what it had of that source."""

    method = "resync"
    served_by = SHARD
    source: Source
    epoch: str
    seq: int
    entries: Iterable[Entry]


@dataclass(frozen=True)
class DropSource(Request[int]):
    """Forget every copy of one source (a tier that is gone); how many."""

    method = "drop_source"
    served_by = SHARD
    source: Source


@dataclass(frozen=True)
class PoolReplicas(Request["dict[str, int]"]):
    """How many pool blocks the shard knows, and how many have fewer than ``want`` copies."""

    method = "pool_replicas"
    served_by = SHARD
    want: int


@dataclass(frozen=True)
class ShardStatsOf(Request["DirectoryStats"]):
    """A shard's figures."""

    method = "stats"
    served_by = SHARD


@dataclass(frozen=True)
class Nodes(Request[list[str]]):
    """The nodes the service runs on."""

    method = "nodes"
    served_by = CONTROLLER


@dataclass(frozen=True)
class PoolMembers(Request[list[str]]):
    """The pool nodes that are members now."""

    method = "pool_members"
    served_by = CONTROLLER


@dataclass(frozen=True)
class Ingest(Request[int]):
    """Blocks another pool node offers to this one (a rebalance); how many were taken."""

    method = "ingest"
    served_by = POOL
    source: str
    offers: Sequence[Offer]


@dataclass(frozen=True)
class DropStaging(Request[int]):
    """Let every staged block of a pool node go (a benchmark between its rounds); how many."""

    method = "drop_staging"
    served_by = POOL


@dataclass(frozen=True)
class Checksums(Request["list[int | None]"]):
    """The checksum of each key a pool node holds, None where it holds none, asked by a
    rebalance of ``generation`` (none is confirmed to an older view than the node's)."""

    method = "checksums"
    served_by = POOL
    keys: Sequence[bytes]
    generation: int = 0
