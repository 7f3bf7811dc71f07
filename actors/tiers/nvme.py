"""Control plane of a node's NVMe tier: the log's space, index, journal and eviction.

The tier hands out extents and records commits; the offload agent writes and reads the
bytes (``actors.agent.nvme``, ``actors.agent.host``). Protocol, in call order:

1. ``reserve([(key, parent, size[, namespace])], owner)`` -> an Extent per key (None if
   already stored or no room). Space is held until commit, abort or the reservation's lease
   expires. The namespace id is kept with the block on disk, so the directory learns it again
   after this tier or the directory restarts (a namespace drop finds the block).
2. The agent writes the extent, then ``commit([(lease, size, checksum, chunk_sums)])``; the
   segment data is made durable and the index record journaled before the block is visible.
3. Compaction (inside a ``reserve`` that needs room) is decided here and its copies made by
   the agent (``AgentMover``: ``move_extents``), so the tier never carries payload bytes.
4. Readers ``pin(keys, owner)`` -> Extents (None on a miss), read and verify, then
   ``unpin([lease])``. A reader that finds a bad checksum calls ``quarantine_extents`` with
   the extents it read: a copy of the key written since, elsewhere, stays.

Pins and reservations are leases (``actors.tiers.leases``), taken back when they expire.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from cmx.actors.directory.shard import Entry, Source
from cmx.actors.tiers.events import EventPublisher
from cmx.actors.tiers.leased import LeasedPins, LeasedTier
from cmx.actors.tiers.leases import ADMIN, Clock, LeaseKind, Leases
from cmx.doors import MoveExtents
from cmx.errors import BlockStateError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.stats import TierStats
from cmx.storage.nvme.dataplane import Extent, extent_pairs
from cmx.storage.nvme.extents import ExtentBooks, PendingExtent
from cmx.storage.nvme.space import ExtentMove, Mover
from cmx.tiers import Tier

__all__ = ["NvmeTierService", "extent_holdings", "extent_tag"]

DEFAULT_LEASE_S = 120.0
# (key, parent, size) or (key, parent, size, namespace id)
Reserve = tuple[BlockHash, BlockHash | None, int] | tuple[BlockHash, BlockHash | None, int, str]


class NvmeTierService(LeasedTier[Extent]):
    def __init__(
        self,
        node: str,
        root: str,
        capacity_bytes: int,
        block_bytes: int,
        directory: Any,
        num_shards: int,
        eviction: str = "lru",
        segment_bytes: int = 256 << 20,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Clock = time.monotonic,
        tier: Tier = Tier.NVME,  # an extents tier's name: NVMe, or one registered (cmx.tiers)
    ) -> None:
        self.tier = tier
        self.node = node
        self.epoch = uuid.uuid4().hex[:8]
        self.store = ExtentBooks(
            root, capacity_bytes=capacity_bytes, block_bytes=block_bytes, eviction=eviction,
            segment_bytes=segment_bytes, mover=AgentMover(directory, node),
        )
        self.leases = Leases(lease_s, clock)
        self.leased = LeasedPins[Extent](self.leases, self.pin, self._unpin_key)
        self._pending: dict[int, PendingExtent] = {}  # lease -> space held for a write
        self._lock = threading.Lock()
        self.publisher = EventPublisher(
            Source(node, tier),
            self.epoch,
            num_shards,
            lambda shard, request: directory.call(f"cmx:dir:{shard}", request),
            self._holdings,
            self.store.event_lock,
            functools.partial(extent_tag, self.store),
        )
        self.store.subscribe(self.publisher.on_event)

    def info(self) -> dict[str, object]:
        return {"tier": self.tier.value, "node": self.node, "epoch": self.epoch,
                "root": self.store.root}

    def reserve(self, items: Sequence[Reserve], owner: str) -> list[Extent | None]:
        self.leases.expire()
        out: list[Extent | None] = []
        for item in items:
            key, parent, size = item[0], item[1], item[2]
            namespace = item[3] if len(item) == 4 else ""
            pending = self.store.reserve_extent(key, parent, size, namespace)
            if pending is None:
                out.append(None)
                continue
            with self._lock:
                lease = self.leases.grant(owner, LeaseKind.RESERVE, key, self._abort_one)
                self._pending[lease] = pending
            out.append(Extent(key, pending.path, pending.offset, size, 0, lease))
        return out

    def commit(self, items: Sequence[tuple[int, int, int, bytes]]) -> int:
        """Commit written extents by lease; how many. A lease that expired commits nothing."""
        done = 0
        for lease, size, csum, chunk_sums in items:
            held = self.leases.take(lease)
            with self._lock:
                pending = self._pending.pop(lease, None) if held is not None else None
            if pending is not None and pending.size == size:
                self.store.commit_extent(pending, csum, chunk_sums)
                done += 1
            elif pending is not None:
                self.store.abort_extent(pending)
        self.store.flush()  # durable before it is announced
        self.publisher.flush()
        return done

    def abort(self, leases: Sequence[int]) -> None:
        self.leases.end(leases)

    def _abort_one(self, lease: int) -> None:
        with self._lock:
            pending = self._pending.pop(lease, None)
        if pending is not None:
            self.store.abort_extent(pending)

    def pin(self, keys: Sequence[BlockHash], owner: str = ADMIN) -> list[Extent | None]:
        self.leases.expire()
        out: list[Extent | None] = []
        for key in keys:
            if not self.store.pin(key):
                out.append(None)
                continue
            entry = self.store.entry_of(key)
            if entry is None:
                self._unpin_key(key)
                out.append(None)
                continue
            lease = self.leases.grant_pin(owner, key, self.leased.unpin_later(key))
            if lease is None:  # a late pin of an owner already released: nobody would end it
                self._unpin_key(key)
                out.append(None)
                continue
            out.append(Extent(key, self.store.segment_path(entry.seg), entry.offset,
                              entry.length, entry.checksum, lease, entry.chunk_sums, entry.tag))
        return out

    # -- undoing pins (``LeasedPins``, ``LeasedTier``) ----------------------------------------

    def _unpin_key(self, key: BlockHash) -> None:
        try:
            self.store.unpin(key)
        except BlockStateError:
            pass  # quarantined under the pin, or closed

    def quarantine(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        for key in keys:
            if self.store.quarantine(key):
                self.leases.forget_key(key)
                n += 1
        self.publisher.flush()
        return n

    def quarantine_extents(self, extents: Sequence[Extent]) -> int:
        """Drop the copies at these extents, found corrupt by their reader."""
        n = 0
        for ext in extents:
            if self.store.quarantine(ext.key, (ext.path, ext.offset)):
                self.leases.forget_key(BlockHash(ext.key))
                n += 1
        self.publisher.flush()
        return n

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [key in self.store for key in keys]

    def evict(self, keys: Sequence[BlockHash]) -> int:
        """Delete unpinned blocks, durably (a namespace drop stays dropped across a restart)."""
        gone = self.store.delete_unpinned(keys)
        if gone:
            self.store.flush()
        self.publisher.flush()
        return gone

    def heartbeat(self) -> bool:
        """Resync the directory; take back leases that ran out (writes that never finished)."""
        self.leases.expire()
        return self.publisher.flush(heartbeat=True)

    def stats(self) -> TierStats:
        s = self.store.stats()
        return TierStats(self.tier, self.node, self.epoch, s, s.pinned, len(self._pending),
                         self.leases.stats())

    def check_integrity(self) -> None:
        self.store.check_integrity()

    def close(self) -> None:
        self.publisher.close()
        self.store.close()

    def _holdings(self) -> list[Entry]:
        return extent_holdings(self.store)


class AgentMover(Mover):
    """Compaction's bytes, moved by the node's agent (its data plane): the tier decides the
    copies and records them, and never reads or writes a block itself."""

    def __init__(self, link: Any, node: str) -> None:
        self._link = link
        self._agent = actor_name("agent", node)

    def move(self, moves: Sequence[ExtentMove]) -> list[bool | None]:
        return list(self._link.call(self._agent, MoveExtents(pairs=extent_pairs(moves))))


def extent_tag(store: ExtentBooks, key: bytes) -> str:
    """The namespace id a just-stored block was reserved with (the store keeps it)."""
    entry = store.entry_of(key)
    return entry.tag if entry is not None else ""


def extent_holdings(store: ExtentBooks) -> list[Entry]:
    """Every committed block of an NVMe store as a directory entry, for a resync."""
    entries = []
    for key in store.keys():
        entry = store.entry_of(key)
        if entry is not None:
            entries.append(Entry(key, True, entry.length, entry.checksum, entry.tag))
    return entries
