"""What the client and the service's actors say to each other: names, copies, the best-copy rule,
and the messages of a load. Core types: the client imports these, never ``cmx.actors``.

- ``actor_name``: every actor of the service by name in the Ray namespace ``cmx``;
  ``arena_name``: the shared memory of a memory tier's incarnation.
- ``Copy`` and ``shard_of``: where a block's copies are, and which directory shard knows.
- ``best_copy``: the one rule for which copy a reader on a node should use; ``copy_tag``: the
  one rule for the namespace id a new copy carries.
- ``Pinned``: a block a memory tier pinned for a reader, read in the arena of its epoch;
  ``Loaded`` / ``LoadResult``: a load's blocks, pinned in this node's HBM arena for the caller;
  ``Staged`` / ``Offer``: blocks a peer or the offering node pinned for one transfer.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cmx.keys import BlockHash
from cmx.tiers import Tier

__all__ = [
    "RAY_NAMESPACE", "Copy", "LoadResult", "Loaded", "Offer", "Pinned", "PinnedColumns",
    "Priority", "Staged",
    "StoreCommit",
    "actor_name", "arena_name", "best_copy", "copy_tag", "held_table_name", "preference",
    "shard_of", "shards_of",
]

RAY_NAMESPACE = "cmx"


def actor_name(kind: str, ident: str | int) -> str:
    """``cmx:dram:<node id>``, ``cmx:agent:<node id>``, ``cmx:dir:3`` and so on."""
    return f"cmx:{kind}:{ident}"


def arena_name(tier: Tier, node: str, epoch: str) -> str:
    """The shared memory of the incarnation ``epoch`` of ``node``'s memory ``tier``: a reader
    maps a pin's slot by this name, so a restarted tier (a new epoch, the old name unlinked)
    can never hand it a slot of another incarnation."""
    return f"cmx-{tier.value}-{node[:12]}-{epoch}"


def held_table_name(tier: Tier, node: str, epoch: str) -> str:
    """The table of keys the incarnation ``epoch`` of ``node``'s memory ``tier`` holds
    (``cmx.storage.held_table``): under the arena's name, so it goes where the arena goes."""
    return f"{arena_name(tier, node, epoch)}-held"


def shard_of(key: bytes, num_shards: int) -> int:
    """The directory shard that knows ``key``: keys are uniform hashes, so their first bytes
    spread them evenly."""
    return int.from_bytes(key[:4], "little") % num_shards


def shards_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """``shard_of`` of each row of ``keys`` (uint8, one key a row), at once."""
    return keys[:, :4].copy().view("<u4")[:, 0] % num_shards


@dataclass(frozen=True)
class Copy:
    """A committed copy of a block somewhere in the cluster."""

    tier: Tier
    node: str
    size: int
    checksum: int


def best_copy(copies: Sequence[Copy], node: str) -> Copy:
    """The copy a reader on ``node`` should use: one on its own node before any other, then the
    fastest tier. ValueError for no copies."""
    if not copies:
        raise ValueError("no copies to choose from")
    return min(copies, key=lambda c: preference(c.tier, c.node, node))


def preference(tier: Tier, where: str, node: str) -> tuple[bool, float]:
    """The order in which a reader on ``node`` takes copies, smaller first (``best_copy``; a
    ``CopyTable`` orders its places by it): on its own node first, then the fastest tier."""
    return where != node, tier.rank


def copy_tag(named: str, source: str) -> str:
    """The namespace id a new copy of a block carries (a namespace drop finds it by it): the
    one its maker names, else the one of the copy it is made from; "" where neither knows."""
    return named or source


@dataclass(frozen=True)
class Pinned:
    """A block a memory tier pinned for a reader (a lease of the reader's owner)."""

    key: BlockHash
    slot: int
    size: int
    checksum: int
    epoch: str  # read ``slot`` in the arena of this epoch (``arena_name``)
    lease: int  # unpin by it
    copy: int = 0  # which copy of the key in that epoch: a quarantine names it, not the key
    namespace: str = ""  # the copy's namespace id ("" for none): copies made from it keep it


@dataclass(frozen=True, eq=False)
class PinnedColumns:
    """``Pinned`` of many keys as columns, what a memory tier answers a reader of a long
    prefix (``PinColumns``): arrays, no object per block. ``held[i]`` says whether the
    ``i``-th key asked was pinned; the other columns list the pinned keys, in order."""

    epoch: str
    held: np.ndarray  # bool, one per key asked
    slot: np.ndarray  # int64, one per pinned key
    size: np.ndarray  # int64
    checksum: np.ndarray  # uint64
    lease: np.ndarray  # int64
    copy: np.ndarray  # int64

    def pinned(self, keys: Sequence[BlockHash], i: int) -> Pinned:
        """The ``i``-th pinned key's ``Pinned`` (``keys``: the pinned keys, in order). Its
        namespace is not sent: a reader copies the bytes out and makes no copy of its own."""
        return Pinned(keys[i], int(self.slot[i]), int(self.size[i]), int(self.checksum[i]),
                      self.epoch, int(self.lease[i]), int(self.copy[i]))

    def as_list(self, keys: Sequence[bytes]) -> list[Pinned | None]:
        """As ``Pin`` answers: one ``Pinned`` a key asked, None where it was not pinned."""
        held = self.held.tolist()
        pinned = [BlockHash(k) for k, h in zip(keys, held) if h]
        pins = (self.pinned(pinned, i) for i in range(len(pinned)))
        return [next(pins) if h else None for h in held]


class Priority(enum.IntEnum):
    LOAD = 0  # a request is waiting on it
    PREFETCH = 1  # a request will want it soon
    DEMOTE = 2  # eviction to a lower tier, write-through and write-back


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
    namespace: str = ""  # the staged copy's namespace id: the reader's copy keeps it


@dataclass(frozen=True)
class Offer:
    """A block pinned in the offering node's arena, for a pool node to pull."""

    key: BlockHash
    parent: BlockHash | None
    region: str
    slot: int
    size: int
    checksum: int
    namespace: str = ""  # its namespace id: the pool node keeps it with the block, on disk


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
    namespace: str = ""  # the namespace id its HBM copy carries ("" for none)


@dataclass(frozen=True)
class StoreCommit:
    """What the commit of a store's written blocks did."""

    committed: int  # blocks now stored and visible to lookups
    # Blocks written but not stored: their grant's lease had ended, their tier had restarted,
    # or their bytes no longer matched the writer's checksum (that copy is then dropped).
    refused: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class LoadResult:
    arena: str  # the HBM arena the slots are in ("" if it is gone: nothing was loaded)
    blocks: list[Loaded]  # the loaded prefix, pinned until ``release`` or the lease expires
