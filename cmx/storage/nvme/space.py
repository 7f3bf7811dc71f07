"""Space: making room for a put (eviction, retiring empty segments, compaction).

Disk space is the budget: every byte below a segment head (live, pending or dead) counts
against ``capacity_bytes``, so a put of an extent of ``e`` bytes waits until
``disk + e <= capacity``. To get there, in order:

1. Retired segments (nothing live left) are deleted after a flush makes the records that
   emptied them durable (and once no read still uses them: a wait of a few milliseconds).
2. When dead space reaches ``compact_threshold_bytes``, the segment with the most dead space
   is compacted: its live blocks are read, verified, rewritten at the log head and the segment
   retired. The copies may use the one segment of slack above capacity; nothing else does.
3. Otherwise the policy's next victim is evicted (unpinned, committed blocks only). Blocks
   written together mostly leave together, so eviction alone usually empties whole segments
   and compaction only copies what hits kept alive in old segments.

Compaction skips segments that hold a pinned block or a write in flight; a block pinned while
its segment is being compacted stays where it is. With nothing left to evict or compact, the
put waits for other writes in flight to commit (they become evictable), and raises
StoreFullError when there are none: everything left is pinned.

Space owns the space lock (one writer makes room at a time, taken before the books' lock)
and its counters; it decides under the books' lock and moves compaction's bytes through the
data plane (``ExtentIo``) outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

from cmx.errors import StoreFullError
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.index import BlockIndex
from cmx.storage.nvme.records import RecordDel
from cmx.storage.nvme.segments import Segment, SegmentSet

__all__ = ["Space"]


class Space:
    def __init__(self, lock: threading.RLock, index: BlockIndex, segs: SegmentSet,
                 io: ExtentIo, capacity: int, compact_threshold: int,
                 remove: Callable[[BlockEntry], None],
                 quarantine: Callable[[BlockEntry], None],
                 note: Callable[[BlockEntry | RecordDel], None],
                 flush: Callable[[], None]) -> None:
        self.lock = threading.Lock()  # the space lock
        self._books = lock
        self._index = index
        self._segs = segs
        self._io = io
        self.capacity = capacity
        self.compact_threshold = compact_threshold
        self._remove = remove  # the books' removal: index, segment, record, event
        self._quarantine = quarantine
        self._note = note  # a record for the next flush
        self._flush = flush
        self.evictions = self.compactions = self.compacted_bytes = 0

    def reserve(self, key: bytes, ext: int) -> tuple[Segment, int] | None:
        """Room for ``ext`` bytes at the log head; None if ``key`` is stored or being stored."""
        with self.lock:
            while True:
                with self._books:
                    if self._index.taken(key):
                        return None
                    if self._segs.disk_bytes + ext <= self.capacity:
                        self._index.reserving.add(key)
                        return self._segs.allocate(ext)
                    step = self._next_step(ext)
                step()

    def _next_step(self, ext: int) -> Callable[[], None]:
        """Decide, under the books' lock, the next move towards room for ``ext`` bytes."""
        segs = self._segs
        if segs.retired_pending():
            return self._flush
        if any(s.retired for s in segs.segs.values()):
            return _wait  # deleted as soon as the reads still using it finish
        if segs.dead_bytes >= self.compact_threshold:
            victim = self._compaction_victim()
            if victim is not None:
                return partial(self._compact, victim)
        if self._evict_some():
            return _nothing
        victim = self._compaction_victim()
        if victim is not None:
            return partial(self._compact, victim)
        if self._index.reserving:
            return _wait  # writes in flight commit soon, and can then be evicted
        raise StoreFullError(
            f"no room for {ext} bytes: disk {segs.disk_bytes} of capacity {self.capacity}, "
            f"{self._index.pinned_blocks} blocks pinned"
        )

    def _evict_some(self) -> int:
        """Evict victims until a segment empties or dead space reaches the threshold."""
        segs = self._segs
        evicted = 0
        for key in self._index.victims():
            entry = self._index.get(key)
            assert entry is not None
            self._remove(entry)
            self.evictions += 1
            evicted += 1
            if segs.retired_pending() or segs.dead_bytes >= self.compact_threshold:
                break
        return evicted

    def _compaction_victim(self) -> Segment | None:
        best = None
        for seg in self._segs.segs.values():
            if seg.retired or seg.pending or seg.dead <= 0:
                continue
            if any(self._index.pinned(k) for k in seg.keys):
                continue
            if best is None or seg.dead > best.dead:
                best = seg
        return best

    def _compact(self, seg: Segment) -> None:
        """Move the live blocks of ``seg`` to the log head, then retire and delete it."""
        with self._books:
            if seg is self._segs.active:
                self._segs.seal(seg)
            entries = sorted((self._index.entries[k] for k in seg.keys), key=lambda e: e.offset)
            seg.io_refs += 1
        moved = 0
        try:
            for entry in entries:
                moved += self._move(entry, seg)
        finally:
            with self._books:
                self._segs.unref(seg)
                self.compactions += 1
                self.compacted_bytes += moved
        self._flush()

    def _still(self, entry: BlockEntry) -> bool:
        return self._index.get(entry.key) is entry and not self._index.pinned(entry.key)

    def _move(self, entry: BlockEntry, seg: Segment) -> int:
        """Copy one block to the log head; the bytes moved (0 if it left or got pinned)."""
        with self._books:
            if not self._still(entry):
                return 0
        extent = self._io.load_checked(seg.fd, entry.offset, entry.length, entry.checksum)
        if extent is None:
            self._quarantine(entry)
            return 0
        with self._books:
            if not self._still(entry):
                return 0
            dst, offset = self._segs.allocate(entry.extent)
        done = False
        try:
            self._io.store(dst.fd, offset, extent)
            done = True
        finally:
            with self._books:
                keep = done and self._still(entry)
                self._segs.finish_write(dst, entry.extent, entry.key if keep else None)
                if keep:
                    new = self._index.move(entry, dst.id, offset)
                    self._segs.drop(entry.seg, entry.key, entry.extent, entry.seq)
                    self._note(new)
                    self._note(RecordDel(entry.key, entry.seq, entry.seg))
        return entry.extent if keep else 0


def _nothing() -> None:
    pass


def _wait() -> None:
    time.sleep(0.001)
