"""DramStore: the host DRAM tier's block store, one slot per block in a shared-memory arena.

Protocol (see ``cmx.storage.base`` for the common part), in call order:

- ``reserve(key, parent)`` takes a free slot, evicting one unpinned committed block through the
  eviction policy if none is free (``on_evict`` sees it first); StoreFullError if every block
  is pinned or reserved. The caller writes ``reservation.buffer``, then ``commit`` (the block
  becomes visible and a STORED event goes out) or ``abort`` (the slot is free again). Until
  then the block is invisible to ``get``, ``in``, ``keys`` and ``pin``, and never evicted.
- ``put`` is reserve + one copy + commit. It returns False, changing nothing, if the key is
  already stored or being written.
- ``get`` copies a block out. ``view`` hands out the slot itself without a copy: only while the
  caller holds a pin (``pin`` ... ``view`` ... ``unpin``); after ``unpin`` the slot may be
  reused for another block at any time and the view then shows that block's bytes.
- ``fence`` ends a reservation whose writer may still be writing (its lease ran out): the key
  is free at once, its slot stays out of use until ``unfence``, so a late write lands where
  no other block lies.
- ``locate`` gives (arena name, slot, offset, size) so the node's offload agent can reach the
  bytes from its own process (``cmx.storage.arena.read_slot``); it too must be under a pin.
- Checksums are lazy: ``put``/``commit`` take one if the caller has it; ``checksum_of``
  computes XXH3 once and caches it. Hashing every put would cost half a memcpy.

Every call takes one lock; ``put`` copies outside it, into a slot no one else can reach. Event
subscribers and ``on_evict`` run under the lock (an RLock: they may read the store). While
``on_evict`` runs, its block is pinned, so nothing re-entrant can take that slot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Container, Sequence
from typing import NamedTuple

import numpy as np

from cmx.buffers import Buffer, align_up, as_bytes_view, copy_bytes
from cmx.checksum import Checksum, checksum
from cmx.errors import BlockStateError, BlockTooLargeError
from cmx.keys import BlockHash, check_key
from cmx.policies.eviction import EvictionPolicy, make_eviction
from cmx.storage.arena import SharedArena, SlotAllocator, SlotRef
from cmx.storage.base import EventKind
from cmx.storage.blocks import (
    BlockMeta,
    OnEvict,
    Reservation,
    block_source,
    check_block_keys,
    check_checksum,
    check_size,
)
from cmx.storage.dram_books import DramBooks, DramEntry

__all__ = ["BlockMeta", "DramStore", "OnEvict", "PinnedRef", "Reservation"]

log = logging.getLogger(__name__)


class PinnedRef(NamedTuple):
    """Where a block pinned by ``pin_refs`` lies, and its checksum."""

    slot: int
    offset: int  # of the slot in the arena's ``buffer``
    size: int
    checksum: int
    copy: int  # names this copy of the block apart from any later one of the same key


class DramStore(DramBooks):
    """Blocks of at most ``block_bytes`` in a ``capacity_bytes`` shared-memory arena.

    Args:
        capacity_bytes: size of the arena; it holds ``capacity_bytes // slot`` blocks, where a
            slot is ``block_bytes`` rounded up to 4 KiB.
        block_bytes: the largest block; smaller ones are stored with their size.
        eviction: eviction policy name (``cmx.policies.make_eviction``) or a fresh instance.
        name: shared-memory name of the arena; unique by default.
        on_evict: called with (key, read-only view, BlockMeta) just before an evicted block's
            slot is reused, to demote it; an exception drops the block and is counted.
        populate: fault the whole arena in at creation, so puts run at memcpy speed.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int,
                 eviction: str | EvictionPolicy = "lru", name: str | None = None,
                 on_evict: OnEvict | None = None, populate: bool = True) -> None:
        super().__init__()
        for label, value in (("capacity_bytes", capacity_bytes), ("block_bytes", block_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        if block_bytes > capacity_bytes:
            raise BlockTooLargeError(f"block_bytes {block_bytes} > capacity {capacity_bytes}")
        self._policy = make_eviction(eviction)
        if len(self._policy):
            raise ValueError(f"eviction policy already holds {len(self._policy)} keys")
        self._arena = SharedArena.create(capacity_bytes, align_up(block_bytes), name, populate)
        self._block_bytes = block_bytes
        self._slots = SlotAllocator(self._arena.num_slots)
        self._index: dict[BlockHash, DramEntry] = {}  # committed and reserved blocks
        self._fenced: set[int] = set()  # slots of ended reservations, held out of use
        self._on_evict = on_evict
        self._lock = threading.RLock()
        self._closed = False
        self._next_id = 0
        self._committed = 0
        self._reserved = 0
        self._pinned = 0  # blocks with at least one pin
        self._used_bytes = 0  # payload bytes of committed blocks
        self._hits = self._misses = self._evictions = self._hook_errors = 0
        self._bytes_written = self._bytes_read = 0

    # -- shape ---------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def arena(self) -> SharedArena:
        """The owner's arena: ``arena.name`` for another process, ``arena.buffer`` for NIXL."""
        return self._arena

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def closed(self) -> bool:
        return self._closed

    # -- two-phase writes ----------------------------------------------------------------------

    def reserve(self, key: bytes, parent: bytes | None = None) -> Reservation:
        """A slot for ``key``; BlockStateError if the key is already stored or reserved."""
        key, parent = check_block_keys(key, parent)
        with self._lock:
            self._check_open()
            held = self._index.get(key)
            if held is not None:
                state = "stored" if held.committed else "reserved"
                raise BlockStateError(f"block {key.hex()[:12]} is already {state}")
            if not self._slots.free:
                self._evict_one()
            slot = self._slots.alloc()
            self._next_id += 1
            self._index[key] = DramEntry(slot, parent, self._next_id)
            self._reserved += 1
            view = self._arena.slot_view(slot)[: self._block_bytes]
            return Reservation(key, parent, slot, view, self._next_id)

    def commit(self, reservation: Reservation, size: int | None = None,
               checksum: int | None = None) -> None:
        """Make the block visible: ``size`` payload bytes (default block_bytes) of the slot."""
        size = self._block_bytes if size is None else size
        check_size(size, self._block_bytes)
        check_checksum(checksum)
        with self._lock:
            self._check_open()
            entry = self._open_entry(reservation)
            entry.committed, entry.size, entry.checksum = True, size, checksum
            self._reserved -= 1
            self._committed += 1
            self._used_bytes += size
            self._bytes_written += size
            self._policy.insert(reservation.key, entry.parent)
            self._emit(EventKind.STORED, reservation.key, size, checksum)

    def abort(self, reservation: Reservation) -> None:
        """Give the slot back; the block was never visible."""
        with self._lock:
            self._check_open()
            entry = self._open_entry(reservation)
            del self._index[reservation.key]
            self._slots.release(entry.slot)
            self._reserved -= 1

    def fence(self, reservation: Reservation) -> int:
        """End a reservation whose writer may still write: the key is free, the slot is held
        out of use until ``unfence(slot)``; returns the slot."""
        with self._lock:
            self._check_open()
            entry = self._open_entry(reservation)
            del self._index[reservation.key]
            self._fenced.add(entry.slot)
            self._reserved -= 1
            return entry.slot

    def unfence(self, slot: int) -> None:
        """Give a fenced slot back to use."""
        with self._lock:
            self._check_open()
            if slot not in self._fenced:
                raise BlockStateError(f"slot {slot} is not fenced")
            self._fenced.discard(slot)
            self._slots.release(slot)

    def put(self, key: bytes, data: Buffer, parent: bytes | None = None, *,
            checksum: int | None = None) -> bool:
        """Store ``data`` (at most block_bytes, C-contiguous); False if already there."""
        key, parent = check_block_keys(key, parent)
        src = block_source(data, self._block_bytes)
        check_checksum(checksum)
        with self._lock:
            self._check_open()
            if key in self._index:
                return False
            reservation = self.reserve(key, parent)
        try:
            copy_bytes(reservation.buffer[: src.nbytes], src)
        except BaseException:
            self.abort(reservation)
            raise
        self.commit(reservation, src.nbytes, checksum)
        return True

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: bytes) -> np.ndarray | None:
        """A copy of the block (uint8, exactly its size), or None on a miss."""
        key = check_key(key)
        with self._lock:
            entry = self._lookup(key)
            if entry is None:
                return None
            out = np.empty(entry.size, dtype=np.uint8)
            # One thread: into new memory the page faults set the pace, and splitting them
            # over threads was no faster here (5.2-8.8 GB/s against 7.5-8.1).
            np.copyto(out, self._payload(entry))
            self._bytes_read += entry.size
            return out

    def get_into(self, key: bytes, out: Buffer) -> int | None:
        """Copy the block into the front of ``out``; its size, or None on a miss."""
        key = check_key(key)
        dst = as_bytes_view(out)
        with self._lock:
            self._check_open()
            entry = self._visible(key)
            if entry is not None and dst.nbytes < entry.size:
                raise BlockTooLargeError(f"block is {entry.size} bytes, out holds {dst.nbytes}")
            entry = self._lookup(key)
            if entry is None:
                return None
            copy_bytes(dst[: entry.size], self._payload(entry))
            self._bytes_read += entry.size
            return entry.size

    def view(self, key: bytes) -> np.ndarray | None:
        """The block's bytes in the arena, read-only, no copy. Valid only while pinned."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            entry = self._visible(key)
            if entry is None:
                return None
            if not entry.pins:
                raise BlockStateError(f"pin block {key.hex()[:12]} before taking a view of it")
            view = self._payload(entry)
            view.flags.writeable = False
            return view

    def locate(self, key: bytes) -> SlotRef | None:
        """Where the block lies in the arena, for another process. Valid only while pinned."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            entry = self._visible(key)
            if entry is None:
                return None
            offset = self._arena.slot_offset(entry.slot)
            return SlotRef(self._arena.name, entry.slot, offset, entry.size, entry.checksum,
                           entry.reservation)

    def checksum_of(self, key: bytes) -> Checksum | None:
        """XXH3-64 of the block, computed on first call and cached; None on a miss."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            entry = self._visible(key)
            if entry is None:
                return None
            if entry.checksum is None:
                entry.checksum = checksum(self._payload(entry))
            return Checksum(entry.checksum)

    def __contains__(self, key: object) -> bool:
        key = check_key(key)
        with self._lock:
            self._check_open()
            return self._visible(key) is not None

    def __len__(self) -> int:
        with self._lock:
            self._check_open()
            return self._committed

    def keys(self) -> list[BlockHash]:
        """Committed keys, a snapshot."""
        with self._lock:
            self._check_open()
            return [k for k, e in self._index.items() if e.committed]

    # -- pins and removal ----------------------------------------------------------------------

    def pin(self, key: bytes) -> bool:
        key = check_key(key)
        with self._lock:
            entry = self._lookup(key)
            if entry is None:
                return False
            entry.pins += 1
            self._pinned += entry.pins == 1
            return True

    def pin_refs(self, keys: Sequence[bytes], skip: Container[bytes] = ()
                 ) -> list[PinnedRef | None]:
        """``pin`` then ``locate`` each key, its checksum known (``checksum_of``), in one hold
        of the lock: a reader's whole prefix in one step (None where a key is not here, or is
        in ``skip``). The hits are counted and touched in the policy together, in order, as
        ``pin`` one key at a time would."""
        checked = [check_key(key) for key in keys]
        with self._lock:
            self._check_open()
            index, offset_of = self._index, self._arena.slot_offset
            refs: list[PinnedRef | None] = []
            hits: list[BlockHash] = []
            asked = 0
            try:
                for key in checked:
                    if key in skip:
                        refs.append(None)
                        continue
                    asked += 1
                    entry = index.get(key)
                    if entry is None or not entry.committed:
                        refs.append(None)
                        continue
                    hits.append(key)
                    entry.pins += 1
                    self._pinned += entry.pins == 1
                    if entry.checksum is None:
                        entry.checksum = checksum(self._payload(entry))
                    refs.append(PinnedRef(entry.slot, offset_of(entry.slot), entry.size,
                                          entry.checksum, entry.reservation))
            finally:  # what was asked is counted, and what was hit touched, even if it raised
                self._hits += len(hits)
                self._misses += asked - len(hits)
                self._policy.touch_many(hits)
            return refs

    def delete(self, key: bytes) -> bool:
        """Remove an unpinned block; False on a miss, BlockStateError if it is pinned."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            entry = self._visible(key)
            if entry is None:
                return False
            if entry.pins:
                raise BlockStateError(f"block {key.hex()[:12]} is pinned {entry.pins} times")
            self._remove(key, entry)
            return True

    def close(self) -> None:
        """Report every block removed, then unmap and unlink the arena. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for key, entry in list(self._index.items()):
                if entry.committed:
                    self._emit(EventKind.REMOVED, key, entry.size, entry.checksum)
            self._closed = True
            self._index.clear()
            self._arena.close()
            self._arena.unlink()

    # -- internals (callers hold the lock) -----------------------------------------------------

    def _lookup(self, key: BlockHash) -> DramEntry | None:
        """A hit (counted, policy touched) or a miss (counted)."""
        self._check_open()
        entry = self._visible(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        self._policy.touch(key)
        return entry

    def _payload(self, entry: DramEntry) -> np.ndarray:
        return self._arena.slot_view(entry.slot)[: entry.size]

    def _open_entry(self, reservation: Reservation) -> DramEntry:
        if not isinstance(reservation, Reservation):
            raise TypeError(f"expected a Reservation, got {type(reservation).__name__}")
        entry = self._index.get(reservation.key)
        if entry is None or entry.reservation != reservation.id or entry.committed:
            raise BlockStateError(
                f"reservation of {reservation.key.hex()[:12]} is no longer open"
            )
        return entry
