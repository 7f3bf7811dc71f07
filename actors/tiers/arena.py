"""Control plane of a memory tier (HBM or DRAM) of one node.

The tier owns capacity, the index and eviction of a shared-memory arena; it never touches a
payload byte. The node's offload agent maps the same arena and moves the bytes.

Protocol, in call order (the agent is the only caller that writes). Every pin and every
reservation is a lease (``actors.tiers.leases``): it names an owner, is ended by its id and is taken
back when it expires, so a holder that fails or dies never keeps a slot.

1. ``reserve([(key, parent)], owner)`` -> a Grant per key (None if the key is already here,
   or no slot can be freed). A grant may carry a ``victim``: an evicted block whose bytes are
   still in the granted slot. The agent demotes the victim to the tier below *before* writing.
2. The agent writes the slot *in the arena of the grant's epoch* (a restarted tier has a new
   arena; the old grant's slot there may hold another block), then ``commit([(lease, size,
   checksum)])`` (visible to lookups once this returns: the directory has applied the event)
   or ``abort([lease])``. A lease of an earlier incarnation commits nothing. A reservation
   its holder did not end (its lease expired, or its owner was released) may still have a
   writer copying into it: its slot is fenced, held out of use for another lease period, so
   that late copy lands in a slot no other block uses (``actors.tiers.fences``;
   ``stats().fenced_slots``).
3. Readers ``pin(keys, owner)`` -> where each block is (None on a miss), read the slots in
   the arena of the pin's epoch, ``unpin([lease])``.

A load asks ``acquire`` (pin what is here, reserve the rest) and ends with ``commit_pinned``
(commit, then pin): two round trips where the steps alone take four. ``quarantine_pinned``
drops the copy a reader's pin named, found corrupt (a pin of an earlier incarnation, or of a
copy since replaced, drops nothing); a pinned one goes when its last pin does, and is pinned
by no one meanwhile.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from cmx.actors.directory.shard import Entry, Source
from cmx.actors.tiers.events import EventPublisher
from cmx.actors.tiers.fences import SlotFences
from cmx.actors.tiers.grants import ArenaInfo, Grant, Victim
from cmx.actors.tiers.held import HeldKeys
from cmx.actors.tiers.leased import LeasedPins, LeasedTier
from cmx.actors.tiers.leases import ADMIN, Clock, LeaseKind, Leases
from cmx.errors import BlockStateError, StoreClosedError, StoreFullError
from cmx.keys import BlockHash
from cmx.protocol import Pinned, PinnedColumns, arena_name, held_table_name
from cmx.stats import TierStats
from cmx.storage.arena import reap_orphans, unlink_prefixed
from cmx.storage.base import EventKind, StoreEvent
from cmx.storage.blocks import BlockMeta, Reservation
from cmx.storage.dram import DramStore, PinnedRef
from cmx.tiers import Tier

__all__ = ["ArenaInfo", "ArenaTierService", "Grant", "Pinned", "Victim"]

DEFAULT_LEASE_S = 90.0


class ArenaTierService(LeasedTier[Pinned]):
    def __init__(
        self,
        tier: Tier,
        node: str,
        capacity_bytes: int,
        block_bytes: int,
        directory: Any,
        num_shards: int,
        eviction: str = "lru",
        emulated: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self.tier = tier
        self.node = node
        self.emulated = emulated
        self.epoch = uuid.uuid4().hex[:8]
        self._evicted: dict[int, Victim] = {}  # slot -> block evicted from it, until granted
        unlink_prefixed(arena_name(tier, node, ""))  # an earlier incarnation's (killed)
        reap_orphans()  # arenas of nodes torn down on this host before
        self.store = DramStore(
            capacity_bytes,
            block_bytes,
            eviction,
            name=arena_name(tier, node, self.epoch),
            on_evict=self._on_evict,
        )
        self.leases = Leases(lease_s, clock)
        self.leased = LeasedPins[Pinned](self.leases, self.pin, lambda key: self._unpin_keys([key]))
        self.fences = SlotFences(self.store, lease_s, clock)
        self._reservations: dict[int, Reservation] = {}  # lease -> open reservation
        self._quarantined = 0
        self._refused = 0  # commits of a lease that had ended or was of an earlier incarnation
        self._tags: dict[BlockHash, str] = {}  # namespace id of blocks stored through here
        self._lock = threading.Lock()
        self.publisher = EventPublisher(
            Source(node, tier),
            self.epoch,
            num_shards,
            lambda shard, request: directory.call(f"cmx:dir:{shard}", request),
            self._holdings,
            self.store._lock,
            lambda key: self._tags.get(BlockHash(key), ""),
        )
        self.store.subscribe(self.publisher.on_event)
        self.store.subscribe(self._forget_tag)
        self.held_keys = HeldKeys(self.store, held_table_name(tier, node, self.epoch))

    def info(self) -> ArenaInfo:
        arena = self.store.arena
        return ArenaInfo(
            self.tier, self.node, arena.name, arena.slot_bytes, arena.num_slots,
            self.emulated, self.epoch,
        )

    # -- writes --------------------------------------------------------------------------------

    def reserve(
        self, items: Sequence[tuple[BlockHash, BlockHash | None]], owner: str
    ) -> list[Grant | None]:
        self.leases.expire()
        self.fences.lift()
        grants: list[Grant | None] = []
        for key, parent in items:
            try:
                res = self.store.reserve(key, parent)
            except (BlockStateError, StoreFullError):
                grants.append(None)
                continue
            with self._lock:
                lease = self.leases.grant(owner, LeaseKind.RESERVE, key, self._fence_one)
                self._reservations[lease] = res
                victim = self._evicted.pop(res.slot, None)
            grants.append(Grant(key, res.slot, self.epoch, lease, victim))
        return grants

    def commit(self, items: Sequence[tuple[int, int, int | None]], namespace: str = "",
               wait: bool = True) -> int:
        """Commit written blocks (by lease) and publish them; returns how many were committed.
        With ``wait``, returns once the directory has them; otherwise they are sent behind."""
        return sum(self.commit_each(items, namespace, wait))

    def commit_each(self, items: Sequence[tuple[int, int, int | None]], namespace: str = "",
                    wait: bool = True) -> list[bool]:
        """``commit``, answering per item whether it was committed (False: its lease had
        ended, or is of an earlier incarnation of this tier)."""
        return [k is not None for k, _ in self._commit(items, namespace, wait, None)]

    def commit_pinned(
        self, items: Sequence[tuple[int, int, int]], namespace: str = "",
        wait: bool = True, owner: str = "", listed: bool = True,
    ) -> list[Pinned | None]:
        """``commit``, then ``pin`` for ``owner`` what was committed, in one round trip: what
        a load asks last, and what a write-through store asks before its NVMe writes. Each
        block is pinned as it is committed, so a reservation running beside this never
        evicts it in between. None for a lease that is not an open reservation here. Copies
        committed not ``listed`` are never published to the directory (a scan's window:
        readers on this node find them in the held table)."""
        self.leases.expire()
        return [p for _, p in self._commit(items, namespace, wait, owner, listed)]

    def _commit(self, items: Sequence[tuple[int, int, int | None]], namespace: str, wait: bool,
                owner: str | None, listed: bool = True
                ) -> list[tuple[BlockHash | None, Pinned | None]]:
        """Commit each item (by lease); with an ``owner``, each is pinned for it under the
        store's lock, from the moment it is visible."""
        done: list[tuple[BlockHash | None, Pinned | None]] = []
        for lease, size, csum in items:
            held = self.leases.take(lease)
            if held is not None and held.kind is LeaseKind.PIN:
                held.undo(lease)  # a pin is no reservation to commit: ended, as abort ends it
                held = None
            with self._lock:
                res = self._reservations.pop(lease, None) if held is not None else None
            if res is None:
                self._refused += 1
                done.append((None, None))
                continue
            if namespace:
                self._tags[res.key] = namespace
            with self.store._lock:
                try:
                    if not listed:
                        self.publisher.unlist(res.key)
                    self.store.commit(res, size, csum)
                except BaseException:  # its lease is taken: the slot goes back here or never
                    try:
                        self.store.abort(res)
                    except (BlockStateError, StoreClosedError):
                        pass  # committed after all (a later step raised): held as committed
                    else:
                        self.publisher.relist(res.key)
                        self._tags.pop(res.key, None)
                    raise
                pin = self._pin([res.key], owner, False)[0] if owner is not None else None
            done.append((res.key, pin))
        if wait:
            self.publisher.flush()
        else:
            self.publisher.flush_soon()
        return done

    def abort(self, leases: Sequence[int]) -> None:
        """Give back reservations their holder will not write: the slots are free at once."""
        for lease in leases:
            held = self.leases.take(lease)
            if held is None:
                continue
            if held.kind is not LeaseKind.RESERVE:
                held.undo(lease)  # a pin: ended as ``unpin`` ends it
                continue
            with self._lock:
                res = self._reservations.pop(lease, None)
            if res is not None:
                self.store.abort(res)

    def _fence_one(self, lease: int) -> None:
        """A reservation ended without its holder (expired, or its owner released): its
        writer may still be copying, so the slot is fenced (``actors.tiers.fences``)."""
        with self._lock:
            res = self._reservations.pop(lease, None)
        if res is not None:
            self.fences.fence(res)

    # -- reads ---------------------------------------------------------------------------------

    def pin(self, keys: Sequence[BlockHash], owner: str = ADMIN) -> list[Pinned | None]:
        self.leases.expire()
        return self._pin(keys, owner)

    def pin_columns(self, keys: Sequence[BlockHash], owner: str = ADMIN) -> PinnedColumns:
        """``pin``, answered as columns: a long prefix's pins with no object per block."""
        self.leases.expire()
        refs, leases = self._pin_refs(keys, owner)
        got = [ref for ref in refs if ref is not None]
        n = len(got)
        return PinnedColumns(
            self.epoch, np.fromiter((ref is not None for ref in refs), bool, len(refs)),
            np.fromiter((r.slot for r in got), np.int64, n),
            np.fromiter((r.size for r in got), np.int64, n),
            np.fromiter((r.checksum for r in got), np.uint64, n),
            np.asarray(leases, np.int64).reshape(n),
            np.fromiter((r.copy for r in got), np.int64, n))

    def _pin(self, keys: Sequence[BlockHash], owner: str, publish: bool = True
             ) -> list[Pinned | None]:
        refs, leases = self._pin_refs(keys, owner, publish)
        granted = iter(leases)
        return [None if ref is None else
                Pinned(key, ref.slot, ref.size, ref.checksum, self.epoch, next(granted),
                       ref.copy, self._tags.get(key, ""))
                for key, ref in zip(keys, refs)]

    def _pin_refs(self, keys: Sequence[BlockHash], owner: str, publish: bool = True
                  ) -> tuple[list[PinnedRef | None], list[int]]:
        """Each key's pinned place (None: not here) and the lease of each pinned, in order;
        nothing pinned for an owner already released. With ``publish``, a copy stored
        unlisted (a scan's window) that is pinned now is read beyond its scan: published."""
        # A doomed key goes at its last unpin, pinned by no one meanwhile.
        refs = self.store.pin_refs(keys, skip=self.held_keys.doomed)
        held = [key for key, ref in zip(keys, refs) if ref is not None]
        leases = self.leases.grant_pins(owner, held, self.leased.unpin_later, self._unpin_keys)
        if leases is None:  # a late pin of an owner already released: nobody would end them
            self._unpin_keys(held)
            return [None] * len(keys), []
        if publish and self.publisher.relist_stored(
                (key, ref.size, ref.checksum) for key, ref in zip(keys, refs) if ref is not None):
            self.publisher.flush()
        return refs, leases

    def acquire(
        self, items: Sequence[tuple[BlockHash, BlockHash | None]], owner: str
    ) -> list[Pinned | Grant | None]:
        """``pin`` each key that is here and ``reserve`` a slot for each that is not: what a
        load asks first, in one round trip."""
        pins = self.pin([key for key, _ in items], owner)
        grants = iter(self.reserve([item for item, p in zip(items, pins) if p is None], owner))
        return [p if p is not None else next(grants) for p in pins]

    # -- undoing pins (``LeasedPins``, ``LeasedTier``) ----------------------------------------

    def _unpin_keys(self, keys: list[BlockHash]) -> None:
        """One pin of each key undone, the store's lock taken once; a key quarantined under
        its pins goes at the last. A key no longer pinned (it went with a close) is passed."""
        try:
            self.store.unpin_many(keys)
        except StoreClosedError:
            return  # the tier is stopping: nothing stays pinned
        doomed = self.held_keys.doomed
        if doomed and any([self._drop(key) for key in keys if key in doomed]):
            self.publisher.flush()

    def quarantine(self, keys: Sequence[BlockHash]) -> int:
        """Drop the copies of ``keys`` held now, found corrupt; a pinned one goes at its last
        unpin. A reader that holds pins quarantines by them (``quarantine_pinned``)."""
        n = self._quarantine(keys)
        self.publisher.flush()
        return n

    def quarantine_pinned(self, pins: Sequence[Pinned]) -> int:
        """Drop the copies these pins named, found corrupt by their reader; a pinned one goes
        at its last unpin. A pin of an earlier incarnation of this tier, or of a copy since
        evicted or stored again, names no copy held here: it drops nothing."""
        with self.store._lock:  # no copy is replaced between the check and the drop
            n = self._quarantine([p.key for p in pins
                                  if p.epoch == self.epoch and self._copy_of(p.key) == p.copy])
        self.publisher.flush()
        return n

    def _quarantine(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        for key in keys:
            if key not in self.store:
                continue
            n += 1
            if not self._drop(key):
                self.held_keys.doom(key)
        self._quarantined += n
        return n

    def _copy_of(self, key: BlockHash) -> int | None:
        ref = self.store.locate(key)
        return ref.copy if ref is not None else None

    def _drop(self, key: BlockHash) -> bool:
        try:
            self.store.delete(key)
            return True
        except BlockStateError:
            return False  # pinned

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [key in self.store for key in keys]

    def held(self, keys: Sequence[BlockHash]) -> list[tuple[int, int] | None]:
        """A lookup's answer for this tier: per key, (size, checksum) of its copy if one is
        committed here and readable, else None (``actors.tiers.held``). Readers on this host
        read the same from the tier's held table without calling."""
        return self.held_keys.answer(keys)

    def evict(self, keys: Sequence[BlockHash]) -> int:
        """Drop unpinned blocks; returns how many left."""
        gone = self.store.delete_unpinned(keys)
        self.publisher.flush()
        return gone

    # -- upkeep --------------------------------------------------------------------------------

    def heartbeat(self) -> bool:
        self.leases.expire()
        self.fences.lift()
        return self.publisher.flush(heartbeat=True)

    def stats(self) -> TierStats:
        s = self.store.stats()
        # A copy a consumer found corrupt is dropped here, not by the store's own checks.
        store = replace(s, quarantined=s.quarantined + self._quarantined)
        return TierStats(self.tier, self.node, self.epoch, store, s.pinned, s.reserved,
                         self.leases.stats(), len(self.fences), self._refused,
                         emulated=self.emulated)

    def check_integrity(self) -> None:
        self.store.check_integrity()
        s = self.store.stats()
        leases = self.leases.stats()
        if leases.reserved != s.reserved:
            raise AssertionError(f"{leases.reserved} reservation leases, "
                                 f"{s.reserved} reserved blocks")
        if bool(leases.pinned) != bool(s.pinned):
            raise AssertionError(f"{leases.pinned} pin leases, {s.pinned} pinned blocks")
        self.fences.check_integrity()
        self.held_keys.check_integrity()

    def close(self) -> None:
        self.publisher.close()
        self.store.close()
        self.held_keys.close()

    # -- helpers -------------------------------------------------------------------------------

    def _on_evict(self, key: BlockHash, view: object, meta: BlockMeta) -> None:
        slot = self.store.locate(key)
        if slot is not None:
            self._evicted[slot.slot] = Victim(key, meta.size, meta.checksum, meta.parent,
                                              self._tags.get(key, ""))

    def _forget_tag(self, event: StoreEvent) -> None:
        if event.kind is EventKind.REMOVED:
            self._tags.pop(event.key, None)

    def _holdings(self) -> list[Entry]:
        refs = ((key, self.store.locate(key)) for key in self.store.keys())
        return [Entry(key, True, ref.size, ref.checksum or 0, self._tags.get(key, ""))
                for key, ref in refs if ref is not None]
