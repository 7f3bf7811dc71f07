"""Space: making room for a put (eviction, retiring empty segments, compaction).

Disk space is the budget: every byte below a segment head (live, pending or dead) counts
against ``capacity_bytes``, so a put of an extent of ``e`` bytes waits until
``disk + e <= capacity``. To get there, in order:

1. Retired segments (nothing live left) are deleted after a flush makes the records that
   emptied them durable (and once no read still uses them: a wait of a few milliseconds).
2. When dead space reaches ``compact_threshold_bytes``, the segment with the most dead space
   is compacted: its live blocks are read, verified, rewritten at the log head and the segment
   retired. The copies may use the one segment of slack above capacity; nothing else does.
   The retired segment is deleted only once the moves are durable: a failed sync of the
   copies' segment puts each block back where it was (``Durability.note_move``).
3. Otherwise the policy's next victim is evicted (unpinned, committed blocks only). Blocks
   written together mostly leave together, so eviction alone usually empties whole segments
   and compaction only copies what hits kept alive in old segments.

Compaction skips segments that hold a pinned block or a write in flight; a block pinned while
its segment is being compacted stays where it is. With nothing left to evict or compact, the
put waits for other writes in flight to commit (they become evictable), and raises
StoreFullError when there are none: everything left is pinned.

Space owns the space lock (one writer makes room at a time, taken before the books' lock)
and its counters; it decides under the books' lock and has compaction's bytes moved outside
it by a ``Mover``: the store's own ``ExtentIo`` (``LocalMover``), or, in the service, the
node's data plane (the tier's books never carry payload).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from cmx.errors import StoreFullError
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.index import BlockIndex
from cmx.storage.nvme.segments import Segment, SegmentSet

__all__ = ["ExtentMove", "LocalMover", "Mover", "Space"]


class Space:
    def __init__(self, lock: threading.RLock, index: BlockIndex, segs: SegmentSet,
                 mover: Mover, capacity: int, compact_threshold: int,
                 remove: Callable[[BlockEntry], None],
                 quarantine: Callable[[BlockEntry], None],
                 note_move: Callable[[BlockEntry, BlockEntry], None],
                 flush: Callable[[], None]) -> None:
        self.lock = threading.Lock()  # the space lock
        self._books = lock
        self._index = index
        self._segs = segs
        self._mover = mover
        self.capacity = capacity
        self.compact_threshold = compact_threshold
        self._remove = remove  # the books' removal: index, segment, record, event
        self._quarantine = quarantine
        self._note_move = note_move  # a block's new record, for the next flush
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
        """Move the live blocks of ``seg`` to the log head, then retire and delete it.

        Destinations for every live block are allocated first, then the mover copies them
        all (outside the lock: in this process, or in the node's data plane), then each
        block that is still there and unpinned moves in the index."""
        with self._books:
            if seg is self._segs.active:
                self._segs.seal(seg)
            entries = sorted((self._index.entries[k] for k in seg.keys), key=lambda e: e.offset)
            moves = []
            for entry in entries:
                if self._still(entry):
                    dst, offset = self._segs.allocate(entry.extent)
                    moves.append(ExtentMove(entry, seg, dst, offset))
            seg.io_refs += 1
        moved = 0
        results: list[bool | None] = [False] * len(moves)
        try:
            if moves:
                results = self._mover.move(moves)
        finally:
            with self._books:
                for m, ok in zip(moves, results, strict=True):
                    moved += self._finish(m, ok)
                self._segs.unref(seg)
                self.compactions += 1
                self.compacted_bytes += moved
            for m, ok in zip(moves, results, strict=True):
                if ok is None:
                    self._quarantine(m.entry)
        self._flush()

    def _still(self, entry: BlockEntry) -> bool:
        return self._index.get(entry.key) is entry and not self._index.pinned(entry.key)

    def _finish(self, m: ExtentMove, ok: bool | None) -> int:
        """Settle one copy (under the books' lock): the block moves if it was copied and is
        still there, unpinned; else its new bytes are dead. The bytes moved."""
        keep = bool(ok) and self._still(m.entry)
        entry = m.entry
        self._segs.finish_write(m.dst, entry.extent, entry.key if keep else None)
        if not keep:
            return 0
        new = self._index.move(entry, m.dst.id, m.dst_offset)
        self._segs.drop(entry.seg, entry.key, entry.extent, entry.seq)
        self._note_move(new, entry)
        return entry.extent


@dataclass(frozen=True, eq=False)
class ExtentMove:
    """One block compaction copies: from its extent in ``src`` to ``dst_offset`` of ``dst``."""

    entry: BlockEntry
    src: Segment
    dst: Segment
    dst_offset: int


class Mover(ABC):
    """Who moves compaction's bytes: this process (``LocalMover``), or the node's data plane."""

    @abstractmethod
    def move(self, moves: Sequence[ExtentMove]) -> list[bool | None]:
        """Copy each block's extent, verified against its checksum; per block True (copied),
        False (not copied) or None (its bytes failed the checksum: quarantine it)."""


class LocalMover(Mover):
    """Compaction's copies through this store's own ``ExtentIo``, one block at a time."""

    def __init__(self, io: ExtentIo) -> None:
        self._io = io

    def move(self, moves: Sequence[ExtentMove]) -> list[bool | None]:
        out: list[bool | None] = []
        for m in moves:
            e = m.entry
            extent = self._io.load_checked(m.src.fd, e.offset, e.length, e.checksum)
            if extent is None:
                out.append(None)
                continue
            self._io.store(m.dst.fd, m.dst_offset, extent)
            out.append(True)
        return out


def _nothing() -> None:
    pass


def _wait() -> None:
    time.sleep(0.001)
