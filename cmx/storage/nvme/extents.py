"""Two-phase extents: the NVMe store's books, with the bytes moved by someone else.

The service splits the NVMe tier into a control plane (the tier actor: space, index, journal,
eviction) and a data plane (the node's offload agent, which writes and reads the segment
files itself with O_DIRECT). ``ExtentStore`` is the store as that control plane sees it: the
same ``NvmeBooks`` that ``NvmeStore`` runs, called without its ``ExtentIo``.

Protocol, in call order:

1. ``reserve_extent(key, parent, size, tag)`` -> a PendingExtent (segment path and offset), or
   None if the key is stored or being stored. The space is held until 2.
2. The writer writes the padded extent, then ``commit_extent(pending, checksum, chunk_sums)``
   (the block is visible; durable at the next ``flush``) or ``abort_extent(pending)``.
3. Readers ``pin(key)``, ``entry_of(key)`` for the extent, read it, ``unpin(key)``. A pinned
   block is never evicted or moved by compaction, so its extent stays valid while pinned.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from cmx.errors import BlockTooLargeError
from cmx.keys import BlockHash, check_key
from cmx.storage.nvme.books import Reservation
from cmx.storage.nvme.chunks import chunk_count, extent_bytes
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.records import check_tag
from cmx.storage.nvme.store import NvmeStore

__all__ = ["ExtentStore", "PendingExtent"]


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


class ExtentStore(NvmeStore):
    @property
    def event_lock(self) -> threading.RLock:
        """Held while events are emitted; hold it to read holdings and sequence together."""
        return self.books.lock

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

    def entry_of(self, key: bytes) -> BlockEntry | None:
        """The index entry of a committed block (segment id, offset, checksums), or None."""
        with self.books.op(), self.books.lock:
            return self.books.index.get(key)

    def segment_path(self, seg_id: int) -> str:
        return self.books.segs.path(seg_id)

    def quarantine(self, key: bytes) -> bool:
        """Drop a block whose bytes failed a reader's checksum; True if it was there."""
        with self.books.op(), self.books.lock:
            entry = self.books.index.get(key)
            if entry is None:
                return False
            self.books.quarantine(entry)
            return True
