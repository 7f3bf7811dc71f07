"""ExtentBooks: the NVMe store's control plane alone, for a service whose bytes move elsewhere.

The service splits the NVMe tier in two: this part, in the tier actor (space, index, journal,
eviction, the decisions of compaction), and the node's data plane (``dataplane.ExtentPlane``
in the agent), which reads and writes the segment files itself. ExtentBooks is composed of
the same ``NvmeBooks`` that ``NvmeStore`` runs, with a ``Mover`` that has compaction's copies
made by the data plane; it holds no reader or writer, so no payload passes through it.

Protocol, in call order:

1. ``reserve_extent(key, parent, size, tag)`` -> a PendingExtent (segment path and offset), or
   None if the key is stored or being stored. The space is held until 2.
2. The writer writes the padded extent, then ``commit_extent(pending, checksum, chunk_sums)``
   (the block is visible; durable at the next ``flush``) or ``abort_extent(pending)``.
3. Readers ``pin(key)``, ``entry_of(key)`` for the extent, read it, ``unpin(key)``. A pinned
   block is never evicted or moved by compaction, so its extent stays valid while pinned.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cmx.errors import BlockStateError, BlockTooLargeError
from cmx.keys import BlockHash, check_key
from cmx.storage.base import EventKind, NvmeStats, StoreEvent
from cmx.storage.nvme.books import NvmeBooks, Reservation
from cmx.storage.nvme.chunks import chunk_count, extent_bytes
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.front import BooksFront
from cmx.storage.nvme.records import check_tag
from cmx.storage.nvme.space import Mover

__all__ = ["ExtentBooks", "PendingExtent"]

_GIB = 1 << 30


@dataclass(frozen=True, eq=False)
class PendingExtent:
    key: BlockHash
    parent: BlockHash | None
    reservation: Reservation
    offset: int
    size: int  # payload bytes; the extent is extent_bytes(size)
    path: str  # the segment file
    since: float = field(default_factory=time.monotonic)
    tag: str = ""  # the owner's label (a namespace id), kept with the block


class ExtentBooks:
    """See the module docstring. ``NvmeStore`` documents the arguments; ``mover`` makes
    compaction's copies (without one, this process's own I/O engine makes them)."""

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, block_bytes: int, *,
                 segment_bytes: int | None = None, eviction: str = "lru",
                 mover: Mover | None = None, files: FileOps | None = None) -> None:
        if capacity_bytes <= 0 or block_bytes <= 0:
            raise ValueError(f"capacity {capacity_bytes} and block_bytes {block_bytes} must be > 0")
        block_ext = extent_bytes(block_bytes)
        if segment_bytes is None:
            segment_bytes = max(min(capacity_bytes // 8 // 4096 * 4096, _GIB), block_ext)
        if segment_bytes < block_ext or segment_bytes % 4096:
            raise ValueError(f"segment_bytes {segment_bytes} must be a multiple of 4096 and hold "
                             f"one block ({block_ext})")
        self.root = os.fspath(root)
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self._subscribers: list[Callable[[StoreEvent], None]] = []
        self._seq = 0
        files = files or FileOps()
        # The engine only registers segment files (and makes compaction's copies when no
        # mover is given): one thread.
        self.io = ExtentIo(make_io_engine("threads", 1, files=files), block_ext)
        try:
            self.books = NvmeBooks(self.root, capacity_bytes, segment_bytes, segment_bytes,
                                   1 << 16, eviction, self.io, files, self._emit, mover)
            self.books.open()
        except BaseException:
            if hasattr(self, "books"):
                self.books.teardown()
            self.io.close()
            raise
        self.front = BooksFront(self.books, self.io)

    # -- answered by the books' front ----------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self.front

    def __len__(self) -> int:
        return len(self.front)

    def keys(self) -> list[BlockHash]:
        return self.front.keys()

    def stats(self) -> NvmeStats:
        return self.front.stats()

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if index, segments, files or policy disagree."""
        self.front.check_integrity()

    def flush(self) -> None:
        self.front.flush()

    def close(self) -> None:
        """Flush, snapshot the index and release files, engine and directory lock. Idempotent."""
        self.front.close()

    # -- events --------------------------------------------------------------------------------

    @property
    def event_lock(self) -> threading.RLock:
        """Held while events are emitted; hold it to read holdings and sequence together."""
        return self.books.lock

    def subscribe(self, callback: Callable[[StoreEvent], None]) -> None:
        """Call ``callback`` for every later event, in sequence order (under ``event_lock``)."""
        self._subscribers.append(callback)

    def _emit(self, kind: EventKind, key: BlockHash, size: int, checksum: int | None) -> None:
        self._seq += 1  # the books emit under their lock
        event = StoreEvent(self._seq, kind, key, size, checksum)
        for callback in self._subscribers:
            callback(event)

    # -- writes --------------------------------------------------------------------------------

    def reserve_extent(
        self, key: bytes, parent: bytes | None, size: int, tag: str = ""
    ) -> PendingExtent | None:
        key = check_key(key)
        parent = None if parent is None else check_key(parent)
        check_tag(tag)
        if size <= 0 or size > self.block_bytes or extent_bytes(size) > self.capacity_bytes:
            raise BlockTooLargeError(
                f"block of {size} bytes exceeds block_bytes {self.block_bytes} or capacity"
            )
        with self.books.op():
            r = self.books.reserve(key, size, parent, tag)
            if r is None:
                return None
            return PendingExtent(BlockHash(key), None if parent is None else BlockHash(parent),
                                 r, r.offset, size, r.seg.path, tag=tag)

    def commit_extent(self, pending: PendingExtent, checksum: int, chunk_sums: bytes) -> None:
        if len(chunk_sums) != 8 * chunk_count(pending.size):
            self.abort_extent(pending)
            raise ValueError(
                f"{len(chunk_sums)} bytes of chunk sums for a block of {pending.size} bytes"
            )
        with self.books.op():
            self.books.commit(pending.reservation, checksum, chunk_sums)

    def abort_extent(self, pending: PendingExtent) -> None:
        with self.books.op():
            self.books.abort(pending.reservation)

    def adopt_tag(self, key: bytes, tag: str, checksum: int) -> bool:
        """Tag a block stored untagged, its bytes untouched (``NvmeBooks.adopt_tag``); durable
        at the next ``flush``. A tag too long to keep is a ValueError before any change."""
        key = check_key(key)
        check_tag(tag)
        with self.books.op():
            return self.books.adopt_tag(key, tag, checksum)

    # -- reads ---------------------------------------------------------------------------------

    def pin(self, key: bytes) -> bool:
        key = check_key(key)
        with self.books.op(), self.books.lock:
            return self.books.index.pin(key)

    def unpin(self, key: bytes) -> None:
        key = check_key(key)
        with self.books.op(), self.books.lock:
            self.books.index.unpin(key)

    def entry_of(self, key: bytes) -> BlockEntry | None:
        """The index entry of a committed block (segment id, offset, checksums), or None."""
        with self.books.op(), self.books.lock:
            return self.books.index.get(key)

    def segment_path(self, seg_id: int) -> str:
        return self.books.segs.path(seg_id)

    # -- removals ------------------------------------------------------------------------------

    def quarantine(self, key: bytes, at: tuple[str, int] | None = None) -> bool:
        """Drop a block whose bytes failed a reader's checksum; True if it was there. With
        ``at`` (segment path, offset: where the reader found it), only that copy: a copy of
        the key written since, elsewhere in the log, stays."""
        with self.books.op(), self.books.lock:
            entry = self.books.index.get(key)
            if entry is None:
                return False
            if at is not None and (self.books.segs.path(entry.seg), entry.offset) != at:
                return False
            self.books.quarantine(entry)
            return True

    def delete_unpinned(self, keys: Iterable[bytes]) -> int:
        """Remove each key that is not pinned (a pinned one stays); how many went."""
        gone = 0
        with self.books.op():
            for key in keys:
                try:
                    gone += self.books.delete(check_key(key))
                except BlockStateError:
                    pass
        return gone
