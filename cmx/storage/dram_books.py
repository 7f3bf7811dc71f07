"""The books of DramStore: its index and counters, what ``stats`` reports of them, the pins read
from them, the invariants ``check_integrity`` holds them to, and eviction (a block leaves the
books, its slot freed, after ``on_evict`` had a pinned view of it). DramStore (dram.py) keeps
them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from cmx.errors import BlockStateError, StoreClosedError, StoreFullError
from cmx.keys import BlockHash, check_key
from cmx.policies.eviction import EvictionPolicy
from cmx.storage.arena import SharedArena, SlotAllocator
from cmx.storage.base import BlockStore, DramStats, EventKind
from cmx.storage.blocks import BlockMeta, OnEvict

__all__ = ["DramBooks", "DramEntry"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DramEntry:
    """One block's place in the arena and its state."""

    slot: int
    parent: BlockHash | None
    reservation: int
    committed: bool = False
    size: int = 0
    checksum: int | None = None
    pins: int = 0


class DramBooks(BlockStore):
    """The state DramStore keeps; set by ``DramStore.__init__``."""

    _arena: SharedArena
    _block_bytes: int
    _slots: SlotAllocator
    _index: dict[BlockHash, DramEntry]  # committed and reserved blocks
    _fenced: set[int]  # slots held out of use after a reservation ended under its writer
    _policy: EvictionPolicy
    _lock: threading.RLock
    _committed: int
    _reserved: int
    _pinned: int  # blocks with at least one pin
    _used_bytes: int  # payload bytes of committed blocks
    _hits: int
    _misses: int
    _evictions: int
    _hook_errors: int
    _bytes_written: int
    _bytes_read: int

    _closed: bool
    _on_evict: OnEvict | None

    @property
    def capacity_bytes(self) -> int:
        """Payload bytes the store can hold: one block per slot."""
        return self._arena.num_slots * self._block_bytes

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"DRAM store {self._arena.name} is closed")

    def stats(self) -> DramStats:
        with self._lock:
            self._check_open()
            return DramStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._used_bytes + self._reserved * self._block_bytes,
                blocks=self._committed,
                pinned=self._pinned,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                arena=self._arena.name,
                slot_bytes=self._arena.slot_bytes,
                slots=self._slots.capacity,
                free_slots=self._slots.free,
                reserved=self._reserved,
                fenced=len(self._fenced),
                eviction=self._policy.name,
                evict_hook_errors=self._hook_errors,
            )

    def check_integrity(self) -> None:
        with self._lock:
            self._check_open()
            self._slots.check_integrity()
            if len(self._index) + len(self._fenced) != self._slots.used:
                raise AssertionError(
                    f"index holds {len(self._index)} blocks + {len(self._fenced)} fenced slots, "
                    f"{self._slots.used} slots in use"
                )
            if stray := [s for s in self._fenced if not self._slots.is_used(s)]:
                raise AssertionError(f"fenced slots {stray} are free")
            slots: set[int] = set(self._fenced)
            committed = reserved = pinned = used = 0
            for key, entry in self._index.items():
                if entry.slot in slots or not self._slots.is_used(entry.slot):
                    raise AssertionError(
                        f"slot {entry.slot} of {key.hex()[:12]} is shared, fenced or free")
                slots.add(entry.slot)
                if not 0 <= entry.size <= self._block_bytes or entry.pins < 0:
                    raise AssertionError(f"{key.hex()[:12]}: size {entry.size} pins {entry.pins}")
                if entry.committed != (key in self._policy):
                    raise AssertionError(f"{key.hex()[:12]}: committed={entry.committed} "
                                         f"but in policy={key in self._policy}")
                if not entry.committed and entry.pins:
                    raise AssertionError(f"{key.hex()[:12]}: reserved but pinned {entry.pins}")
                committed += entry.committed
                reserved += not entry.committed
                pinned += entry.pins > 0
                used += entry.size if entry.committed else 0
            counted = (committed, reserved, pinned, used)
            kept = (self._committed, self._reserved, self._pinned, self._used_bytes)
            if counted != kept:
                raise AssertionError(f"(committed, reserved, pinned, used bytes) are {counted}, "
                                     f"counters say {kept}")
            if len(self._policy) != committed:
                raise AssertionError(f"policy holds {len(self._policy)}, {committed} committed")
            self._policy.check_integrity()

    # -- eviction (callers hold the lock) ------------------------------------------------------

    def _evict_one(self) -> None:
        for victim in self._policy.victims(self._evictable):
            key = BlockHash(victim)
            entry = self._index[key]
            if self._on_evict is not None:
                self._demote(key, entry)
            self._remove(key, entry)
            self._evictions += 1
            return
        raise StoreFullError(
            f"no slot can be freed: {self._slots.capacity} slots, {self._pinned} blocks pinned, "
            f"{self._reserved} reserved, {len(self._fenced)} fenced"
        )

    def _evictable(self, key: bytes) -> bool:
        entry = self._index.get(BlockHash(key))
        return entry is not None and entry.committed and not entry.pins

    def _demote(self, key: BlockHash, entry: DramEntry) -> None:
        assert self._on_evict is not None
        view = self._arena.slot_view(entry.slot)[: entry.size]
        view.flags.writeable = False
        entry.pins += 1
        self._pinned += 1
        try:
            self._on_evict(key, view, BlockMeta(entry.size, entry.checksum, entry.parent))
        except Exception:
            # A cache may always drop a block: a failed demotion costs a later miss, nothing more.
            self._hook_errors += 1
            log.exception("on_evict failed for block %s; dropping it", key.hex()[:12])
        finally:
            entry.pins -= 1
            self._pinned -= 1

    def unpin(self, key: bytes) -> None:
        key = check_key(key)
        with self._lock:
            self._check_open()
            entry = self._visible(key)
            if entry is None or not entry.pins:
                raise BlockStateError(f"block {key.hex()[:12]} is not pinned")
            entry.pins -= 1
            self._pinned -= entry.pins == 0

    def unpin_many(self, keys: Iterable[BlockHash]) -> None:
        """``unpin`` one pin of each key (pinned by ``pin_refs``, so already checked), in one
        hold of the lock; a key no longer pinned here is passed over."""
        with self._lock:
            self._check_open()
            index = self._index
            for key in keys:
                entry = index.get(key)
                if entry is None or not entry.committed or not entry.pins:
                    continue
                entry.pins -= 1
                self._pinned -= entry.pins == 0

    def _visible(self, key: BlockHash) -> DramEntry | None:
        entry = self._index.get(key)
        return entry if entry is not None and entry.committed else None

    def _remove(self, key: BlockHash, entry: DramEntry) -> None:
        del self._index[key]
        self._policy.remove(key)
        self._slots.release(entry.slot)
        self._committed -= 1
        self._used_bytes -= entry.size
        self._emit(EventKind.REMOVED, key, entry.size, entry.checksum)
