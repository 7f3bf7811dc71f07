"""Making room for a put: eviction, retiring empty segments, compaction.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np

from cmx.checksum import checksum
from cmx.errors import StoreFullError
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.records import RecordDel
from cmx.storage.nvme.segments import Segment
from cmx.storage.nvme.staging import alloc_aligned
from cmx.storage.nvme.state import NvmeState

__all__ = ["SpaceMixin"]


class SpaceMixin(NvmeState):
    """The space-making part of NvmeStore (see state.py for what the parts share)."""

    def _reserve(self, key: bytes, ext: int) -> tuple[Segment, int] | None:
        """Room for ``ext`` bytes at the log head; None if ``key`` is stored or being stored."""
        with self._space_lock:
            while True:
                with self._lock:
                    if key in self._index or key in self._reserving:
                        return None
                    if self._segs.disk_bytes + ext <= self._capacity:
                        self._reserving.add(key)
                        return self._segs.allocate(ext)
                    step = self._next_step(ext)
                step()

    def _next_step(self, ext: int) -> Callable[[], None]:
        """Decide, under _lock, the next move towards room for ``ext`` bytes."""
        segs = self._segs
        if segs.retired_pending():
            return self._flush
        if any(s.retired for s in segs.segs.values()):
            return _wait  # deleted as soon as the reads still using it finish
        if segs.dead_bytes >= self._compact_threshold:
            victim = self._compaction_victim()
            if victim is not None:
                return partial(self._compact, victim)
        if self._evict_some():
            return _nothing
        victim = self._compaction_victim()
        if victim is not None:
            return partial(self._compact, victim)
        if self._reserving:
            return _wait  # writes in flight commit soon, and can then be evicted
        raise StoreFullError(
            f"no room for {ext} bytes: disk {segs.disk_bytes} of capacity {self._capacity}, "
            f"{sum(1 for k in self._pins if k in self._index)} blocks pinned"
        )

    def _evict_some(self) -> int:
        """Evict victims until a segment empties or dead space reaches the threshold."""
        segs = self._segs
        evicted = 0
        for key in self._policy.victims(self._evictable):
            self._remove(self._index[key])
            self._counts["evictions"] += 1
            evicted += 1
            if segs.retired_pending() or segs.dead_bytes >= self._compact_threshold:
                break
        return evicted

    def _evictable(self, key: bytes) -> bool:
        return key in self._index and not self._pins.get(key)

    def _compaction_victim(self) -> Segment | None:
        best = None
        for seg in self._segs.segs.values():
            if seg.retired or seg.pending or seg.dead <= 0:
                continue
            if any(self._pins.get(k) for k in seg.keys):
                continue
            if best is None or seg.dead > best.dead:
                best = seg
        return best

    def _compact(self, seg: Segment) -> None:
        """Move the live blocks of ``seg`` to the log head, then retire and delete it."""
        with self._lock:
            if seg is self._segs.active:
                self._segs.seal(seg)
            entries = sorted((self._index[k] for k in seg.keys), key=lambda e: e.offset)
            seg.io_refs += 1
        moved = 0
        try:
            for entry in entries:
                moved += self._move(entry, seg)
        finally:
            with self._lock:
                self._segs.unref(seg)
                self._counts["compactions"] += 1
                self._counts["compacted_bytes"] += moved
        self._flush()

    def _move(self, entry: BlockEntry, seg: Segment) -> int:
        """Copy one block to the log head; the bytes moved (0 if it left or got pinned)."""
        with self._lock:
            if self._index.get(entry.key) is not entry or self._pins.get(entry.key):
                return 0
        buf = self._compact_buffer(entry.extent)
        self._engine.read([(seg.fd, entry.offset, buf)])
        if checksum(buf[: entry.length]) != entry.checksum:
            self._quarantine(entry)
            return 0
        with self._lock:
            if self._index.get(entry.key) is not entry or self._pins.get(entry.key):
                return 0
            dst, offset = self._segs.allocate(entry.extent)
        done = False
        try:
            self._engine.write([(dst.fd, offset, buf)])
            done = True
        finally:
            with self._lock:
                keep = (done and self._index.get(entry.key) is entry
                        and not self._pins.get(entry.key))
                self._segs.finish_write(dst, entry.extent, entry.key if keep else None)
                if keep:
                    new = entry.moved(dst.id, offset, self._next_seq)
                    self._next_seq += 1
                    self._index[entry.key] = new
                    self._segs.drop(entry.seg, entry.key, entry.extent, entry.seq)
                    self._pending.append(new)
                    self._pending.append(RecordDel(entry.key, entry.seq, entry.seg))
        return entry.extent if keep else 0

    def _compact_buffer(self, nbytes: int) -> np.ndarray:
        """A reused aligned buffer for compaction copies (compaction holds _space_lock)."""
        buf = getattr(self, "_cbuf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._cbuf = alloc_aligned(max(nbytes, self._wstage.nbytes))
        return buf[:nbytes]


def _nothing() -> None:
    pass


def _wait() -> None:
    time.sleep(0.001)
