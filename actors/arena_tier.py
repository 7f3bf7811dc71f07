"""Control plane of a memory tier (HBM or DRAM) of one node.

The tier owns capacity, the index and eviction of a shared-memory arena; it never touches a
payload byte. The node's offload agent maps the same arena and moves the bytes.

Protocol, in call order (the agent is the only caller that writes):

1. ``reserve([(key, parent)])`` -> a Grant per key (None if the key is already here, or no
   slot can be freed). A grant may carry a ``victim``: an evicted block whose bytes are still
   in the granted slot. The agent demotes the victim to the tier below *before* writing.
2. The agent writes the slot, then ``commit([(key, size, checksum)])`` (visible to lookups
   once this returns: the directory has applied the event) or ``abort([key])``.
3. Readers ``pin(keys)`` -> where each block is (None on a miss), read the slots, ``unpin``.

A load asks ``acquire`` (pin what is here, reserve the rest) and ends with ``commit_pinned``
(commit, then pin): two round trips where the steps alone take four.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from cmx.actors.directory import Entry, Source
from cmx.actors.events import EventPublisher
from cmx.errors import BlockStateError, StoreFullError
from cmx.keys import BlockHash
from cmx.storage.arena import SHM_DIR, reap_orphans
from cmx.storage.base import EventKind, StoreEvent
from cmx.storage.blocks import BlockMeta, Reservation
from cmx.storage.dram import DramStore
from cmx.tiers import Tier

__all__ = ["ArenaInfo", "ArenaTierService", "Grant", "Pinned", "Victim"]


@dataclass(frozen=True)
class Victim:
    key: BlockHash
    size: int
    checksum: int | None
    parent: BlockHash | None


@dataclass(frozen=True)
class Grant:
    key: BlockHash
    slot: int
    epoch: str  # of the tier that granted it: a restarted tier has a new arena
    victim: Victim | None = None  # demote it out of ``slot`` before writing


@dataclass(frozen=True)
class Pinned:
    key: BlockHash
    slot: int
    size: int
    checksum: int | None
    epoch: str


@dataclass(frozen=True)
class ArenaInfo:
    tier: Tier
    node: str
    arena: str  # shared-memory name the agent attaches
    slot_bytes: int
    num_slots: int
    emulated: bool  # an HBM tier on host memory (no GPU)
    epoch: str


class ArenaTierService:
    def __init__(
        self,
        tier: Tier,
        node: str,
        capacity_bytes: int,
        block_bytes: int,
        directory: object,
        num_shards: int,
        eviction: str = "lru",
        emulated: bool = False,
    ) -> None:
        self.tier = tier
        self.node = node
        self.emulated = emulated
        self.epoch = uuid.uuid4().hex[:8]
        self._evicted: dict[int, Victim] = {}  # slot -> block evicted from it, until granted
        _unlink_stale_arenas(f"cmx-{tier.value}-{node[:12]}-")
        reap_orphans()  # arenas of nodes torn down on this host before
        self.store = DramStore(
            capacity_bytes,
            block_bytes,
            eviction,
            name=f"cmx-{tier.value}-{node[:12]}-{self.epoch}",
            on_evict=self._on_evict,
        )
        self._reservations: dict[BlockHash, Reservation] = {}
        self._tags: dict[BlockHash, str] = {}  # namespace id of blocks stored through here
        self._lock = threading.Lock()
        self.publisher = EventPublisher(
            Source(node, tier),
            self.epoch,
            num_shards,
            lambda shard, method, *args: directory.call(  # type: ignore[attr-defined]
                f"cmx:dir:{shard}", method, *args
            ),
            self._holdings,
            self.store._lock,
            lambda key: self._tags.get(key, ""),
        )
        self.store.subscribe(self.publisher.on_event)
        self.store.subscribe(self._forget_tag)

    def info(self) -> ArenaInfo:
        arena = self.store.arena
        return ArenaInfo(
            self.tier, self.node, arena.name, arena.slot_bytes, arena.num_slots,
            self.emulated, self.epoch,
        )

    # -- writes --------------------------------------------------------------------------------

    def reserve(self, items: Sequence[tuple[BlockHash, BlockHash | None]]) -> list[Grant | None]:
        grants: list[Grant | None] = []
        for key, parent in items:
            try:
                res = self.store.reserve(key, parent)
            except (BlockStateError, StoreFullError):
                grants.append(None)
                continue
            with self._lock:
                self._reservations[key] = res
                victim = self._evicted.pop(res.slot, None)
            grants.append(Grant(key, res.slot, self.epoch, victim))
        return grants

    def commit(self, items: Sequence[tuple[BlockHash, int, int]], namespace: str = "",
               wait: bool = True) -> int:
        """Commit written blocks and publish them; returns how many were committed. With
        ``wait``, returns once the directory has them; otherwise they are sent behind."""
        done = 0
        for key, size, csum in items:
            with self._lock:
                res = self._reservations.pop(key, None)
            if res is not None:
                if namespace:
                    self._tags[key] = namespace
                self.store.commit(res, size, csum)
                done += 1
        if wait:
            self.publisher.flush()
        else:
            self.publisher.flush_soon()
        return done

    def commit_pinned(
        self, items: Sequence[tuple[BlockHash, int, int]], namespace: str = "",
        wait: bool = True,
    ) -> list[Pinned | None]:
        """``commit``, then ``pin`` what was committed: what a load asks last, in one round
        trip. None for a block that was not reserved here."""
        self.commit(items, namespace, wait)
        return self.pin([key for key, _, _ in items])

    def abort(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            with self._lock:
                res = self._reservations.pop(key, None)
            if res is not None:
                self.store.abort(res)

    # -- reads ---------------------------------------------------------------------------------

    def pin(self, keys: Sequence[BlockHash]) -> list[Pinned | None]:
        out: list[Pinned | None] = []
        for key in keys:
            if not self.store.pin(key):
                out.append(None)
                continue
            ref = self.store.locate(key)
            if ref is None:  # removed between pin and locate: cannot happen under a pin
                self.store.unpin(key)
                out.append(None)
                continue
            out.append(Pinned(key, ref.slot, ref.size, ref.checksum, self.epoch))
        return out

    def acquire(
        self, items: Sequence[tuple[BlockHash, BlockHash | None]]
    ) -> list[Pinned | Grant | None]:
        """``pin`` each key that is here and ``reserve`` a slot for each that is not: what a
        load asks first, in one round trip."""
        pins = self.pin([key for key, _ in items])
        grants = iter(self.reserve([item for item, p in zip(items, pins) if p is None]))
        return [p if p is not None else next(grants) for p in pins]

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            try:
                self.store.unpin(key)
            except BlockStateError:
                pass  # the tier restarted since the pin, or a double release: nothing held

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [key in self.store for key in keys]

    def evict(self, keys: Sequence[BlockHash]) -> int:
        """Drop unpinned blocks; returns how many left."""
        gone = self.store.delete_unpinned(keys)
        self.publisher.flush()
        return gone

    # -- upkeep --------------------------------------------------------------------------------

    def heartbeat(self) -> bool:
        return self.publisher.flush(heartbeat=True)

    def stats(self) -> dict[str, object]:
        s = self.store.stats()
        return {
            "tier": self.tier.value,
            "node": self.node,
            "emulated": self.emulated,
            "epoch": self.epoch,
            "capacity_bytes": s.capacity_bytes,
            "used_bytes": s.used_bytes,
            "blocks": s.blocks,
            "pinned": s.pinned,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "bytes_in": s.bytes_written,
            "bytes_out": s.bytes_read,
            "directory_failures": self.publisher.failures,
            "directory_resyncs": self.publisher.resyncs,
        }

    def check_integrity(self) -> None:
        self.store.check_integrity()

    def close(self) -> None:
        self.store.close()

    # -- helpers -------------------------------------------------------------------------------

    def _on_evict(self, key: BlockHash, view: object, meta: BlockMeta) -> None:
        slot = self.store.locate(key)
        if slot is not None:
            self._evicted[slot.slot] = Victim(key, meta.size, meta.checksum, meta.parent)

    def _forget_tag(self, event: StoreEvent) -> None:
        if event.kind is EventKind.REMOVED:
            self._tags.pop(event.key, None)

    def _holdings(self) -> list[Entry]:
        entries = []
        for key in self.store.keys():
            ref = self.store.locate(key)
            if ref is not None:
                entries.append(
                    Entry(key, True, ref.size, ref.checksum or 0, self._tags.get(key, ""))
                )
        return entries


def _unlink_stale_arenas(prefix: str) -> None:
    """Remove arenas an earlier incarnation of this tier left behind (it was killed).

    One tier of a kind runs per node, so every arena with this node's and kind's prefix is
    from a dead process; a reader still mapping one keeps its mapping until it re-attaches.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
