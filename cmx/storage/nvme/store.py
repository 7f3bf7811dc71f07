"""NvmeStore: the thin facade of the local NVMe tier over its parts.

Who owns what:

- ``NvmeBooks`` (books.py), the control plane: the lock, operations in progress, counters,
  and the parts it composes: ``BlockIndex`` (entries, pins, policy, sequence numbers),
  ``SegmentSet`` (segment files and their bytes' books), ``Space`` (eviction, compaction),
  ``Durability`` (journal, record logs, snapshot, flush).
- ``ExtentIo`` (extentio.py), the data plane: the I/O engine and staging buffers; it moves
  bytes between caller buffers and extents it is told of, and decides nothing.
- ``Writer``, ``BlockReader``, ``SliceReader``: each operation's two phases around its bytes
  (reserve -> write -> commit; lookup -> read -> release and verify).

NvmeStore builds them and forwards each public call, in an operation bracket (``close``
waits for it), to one of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cmx.buffers import Buffer, as_bytes_view
from cmx.keys import BlockHash, check_key
from cmx.policies import EvictionPolicy
from cmx.storage.base import BlockStore, NvmeStats
from cmx.storage.nvme.blockreads import BlockReader
from cmx.storage.nvme.books import NvmeBooks
from cmx.storage.nvme.chunks import extent_bytes
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.front import BooksFront
from cmx.storage.nvme.records import check_tag
from cmx.storage.nvme.slices import RunRequest, SliceReader
from cmx.storage.nvme.space import Mover
from cmx.storage.nvme.writes import PutItem, Writer

__all__ = ["NvmeLocation", "NvmeStore", "PutItem"]

_GIB = 1 << 30


@dataclass(frozen=True)
class NvmeLocation:
    path: str  # segment file
    offset: int  # of the extent in the file, 4 KiB-aligned
    length: int  # payload bytes (the extent is padded with zeros to 4 KiB)
    checksum: int  # XXH3-64 of the payload


class NvmeStore(BlockStore):
    """Blocks in log-structured segment files under ``root``, one store per directory.

    Visibility and durability: a block is readable (``get``, ``in``) once ``put`` returns.
    ``flush()`` returns once every block put before it is durable: the segment files are
    fdatasync'ed, the blocks recorded in their segments' record logs, then the index records
    appended to the journal and fsync'ed. A crash loses at most what was put after the last
    flush; it never exposes a torn or unwritten block, since records are written only after
    their data and every read checks checksums. ``close()`` flushes and snapshots the index;
    reopening the directory finds every block that was flushed, even if the snapshot is
    lost or damaged (it is rebuilt from the journal and the record logs).

    Reads verify on every access: the block checksum on whole-block reads, the 128 KiB chunk
    checksums on slice reads (``read_runs``). A mismatch is a miss: the block is quarantined
    (removed, counted in ``stats().quarantined``) and never returned.

    ``put``, ``get_into``, ``get_many`` and ``get_many_into`` move bytes straight between the
    caller's buffer and the disk when the buffer is page-aligned, and through a fixed-size
    staging buffer when it is not. All methods are thread-safe; I/O runs outside the lock.

    Arguments:
        root: directory of the store (created 0700 if missing; refused if it is a symlink or
            another user's); one open store per directory. Files are 0600.
        capacity_bytes: bytes of block extents (payload padded to 4 KiB) the store may hold;
            dead space counts too until compaction reclaims it. Segment files on disk never
            exceed ``capacity_bytes + segment_bytes`` (the slack compaction copies into, and
            the active segment's space allocated ahead of its writes).
        block_bytes: the largest block accepted.
        segment_bytes: size of one segment file; default capacity/8 within [one block, 1 GiB].
        eviction: eviction policy name (``cmx.policies.make_eviction``) or instance.
        io_engine: "threads", "nixl" or "auto" (see ``engines.AUTO_ORDER``).
        queue_depth: I/Os in flight per engine; io_bytes: the largest single I/O.
        staging_bytes: budget of each of the two staging buffers (writes, reads) used for
            unaligned caller buffers; at most one block's extent is mapped.
        compact_threshold_bytes: dead space above which compaction runs before eviction
            when a put needs room; default one segment.
        snapshot_every: journal records after which a flush writes a snapshot instead.
        files: the file system calls (``files.FileOps``); the crash tests pass one that
            records them.
        mover: who copies compaction's bytes (``space.Mover``); default this store's own
            I/O engine. The service's NVMe tier passes one that asks the node's data plane.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        *,
        segment_bytes: int | None = None,
        eviction: str | EvictionPolicy = "lru",
        io_engine: str = "auto",
        queue_depth: int = 16,
        io_bytes: int = 4 << 20,
        staging_bytes: int = 64 << 20,
        compact_threshold_bytes: int | None = None,
        snapshot_every: int = 1 << 16,
        files: FileOps | None = None,
        mover: Mover | None = None,
    ) -> None:
        super().__init__()
        if capacity_bytes <= 0 or block_bytes <= 0:
            raise ValueError(f"capacity {capacity_bytes} and block_bytes {block_bytes} must be > 0")
        block_ext = extent_bytes(block_bytes)
        if segment_bytes is None:
            segment_bytes = min(max(block_ext, capacity_bytes // 8 // 4096 * 4096), _GIB)
            segment_bytes = max(segment_bytes, block_ext)
        if segment_bytes < block_ext or segment_bytes % 4096:
            raise ValueError(f"segment_bytes {segment_bytes} must be a multiple of 4096 and hold "
                             f"one block ({block_ext})")
        self.root = os.fspath(root)
        self._block_bytes = block_bytes
        files = files or FileOps()
        self._engine = make_io_engine(io_engine, queue_depth, io_bytes, files)
        self.io = ExtentIo(self._engine, min(staging_bytes, block_ext))
        try:
            self.books = NvmeBooks(self.root, capacity_bytes, segment_bytes,
                                   compact_threshold_bytes or segment_bytes, snapshot_every,
                                   eviction, self.io, files, self._emit, mover)
        except BaseException:
            self.io.close()
            raise
        try:
            self.books.open()
        except BaseException:
            self._teardown()
            raise
        self.front = BooksFront(self.books, self.io)
        self._writer = Writer(self.books, self.io, block_bytes)
        self._blocks = BlockReader(self.books, self.io)
        self._slices = SliceReader(self.books, self.io)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.books.capacity

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: bytes, data: Buffer, parent: bytes | None = None, tag: str = "") -> bool:
        """Store a block; ``tag`` (a namespace id) is kept with it across reopen."""
        checked = self._writer.check(key, data, parent, tag)
        with self.books.op():
            return self._writer.put(*checked)

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """``put`` of every (key, data, parent[, tag]), with the writes of all blocks in flight.

        Page-aligned blocks go to the disk together (the engine keeps ``queue_depth`` I/Os in
        flight across them); any other block is put on its own. Each block is readable once
        this returns; a block whose write fails is not stored and its error is raised after
        the others are settled. Returns, per item, whether it was stored (False: already there).
        """
        with self.books.op():
            return self._writer.put_many(items)

    # -- reading -------------------------------------------------------------------------------

    def get(self, key: bytes) -> np.ndarray | None:
        with self.books.op():
            return self._blocks.get(key)

    def get_into(self, key: bytes, out: Buffer) -> bool:
        """Read the block into ``out[:length]``; False on a miss (``out`` then holds garbage).

        ``out`` must be writable and at least the block's length; bytes past the block are
        left alone. A page-aligned ``out`` (a shared-memory arena slot) is read into directly.
        """
        dst = as_bytes_view(out)
        if not dst.flags.writeable:
            raise ValueError("get_into needs a writable buffer")
        with self.books.op():
            return self._blocks.get_into(key, dst)

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Blocks of ``keys`` (None for each miss), with reads of many blocks in flight at once.

        Reads are submitted ahead up to ``queue_depth x io_bytes`` bytes (at least one block);
        each block is verified while later ones are still being read.
        """
        with self.books.op():
            return self._blocks.get_many(keys)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[bool]:
        """``get_into`` of each key into its buffer, with reads of many blocks in flight at once.

        The loader's call: a prefix into its arena slots. A block whose length is a multiple of
        4 KiB (every KV block) lands in a page-aligned buffer straight from the disk, with the
        reads of many blocks in flight; any other is read at once, its tail through staging, so
        bytes past a block are left alone. A buffer smaller than its block raises ValueError.
        """
        with self.books.op():
            return self._blocks.get_many_into(keys, outs)

    def read_runs(self, requests: Sequence[RunRequest]) -> list[np.ndarray | None]:
        """Exactly ``length`` bytes at ``offset`` of each block (see ``SliceReader``)."""
        with self.books.op():
            return self._slices.read_runs(requests)

    # -- pins and removal ----------------------------------------------------------------------

    def pin(self, key: bytes) -> bool:
        key = check_key(key)
        with self.books.op(), self.books.lock:
            return self.books.index.pin(key)

    def unpin(self, key: bytes) -> None:
        key = check_key(key)
        with self.books.op(), self.books.lock:
            self.books.index.unpin(key)

    def delete(self, key: bytes) -> bool:
        """Remove an unpinned block; False if absent. Deleting a pinned block raises."""
        key = check_key(key)
        with self.books.op():
            return self.books.delete(key)

    def delete_tagged(self, tag: str) -> int:
        """Remove every unpinned block stored with ``tag`` (a namespace drop); the count.
        Durable, like every removal, once ``flush()`` returns."""
        check_tag(tag)
        if not tag:
            raise ValueError("delete_tagged needs a non-empty tag")
        with self.books.op():
            return self.books.delete_tagged(tag)

    # -- questions -----------------------------------------------------------------------------

    def locate(self, key: bytes) -> NvmeLocation | None:
        """Where a committed block lies on disk (for tools and tests), or None."""
        key = check_key(key)
        with self.books.op(), self.books.lock:
            entry = self.books.index.get(key)
            if entry is None:
                return None
            return NvmeLocation(self.books.segs.path(entry.seg), entry.offset, entry.length,
                                entry.checksum)

    def tag_of(self, key: bytes) -> str | None:
        """The tag a committed block was stored with ("" for none), or None if absent."""
        with self.books.op(), self.books.lock:
            entry = self.books.index.get(key)
            return None if entry is None else entry.tag

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

    def _teardown(self) -> None:
        """Release everything without a flush or snapshot, as a killed process would."""
        self.books.teardown()
        self.io.close()
