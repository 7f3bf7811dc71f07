"""NvmeStore: the public surface of the local NVMe tier (reads in blockreads.py and slices.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cmx.buffers import ALIGN, Buffer, as_bytes_view, is_aligned
from cmx.errors import BlockStateError, BlockTooLargeError
from cmx.keys import BlockHash, check_key
from cmx.storage.nvme.blockreads import BlockReadsMixin
from cmx.storage.nvme.chunks import extent_bytes
from cmx.storage.nvme.core import NvmeCore
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.io import IoBatch, wait_all
from cmx.storage.nvme.records import check_tag
from cmx.storage.nvme.segments import Segment
from cmx.storage.nvme.slices import SliceReadsMixin

__all__ = ["NvmeLocation", "NvmeStore", "PutItem"]

# (key, data, parent) or (key, data, parent, tag)
PutItem = tuple[bytes, Buffer, bytes | None] | tuple[bytes, Buffer, bytes | None, str]


@dataclass(frozen=True)
class NvmeLocation:
    path: str  # segment file
    offset: int  # of the extent in the file, 4 KiB-aligned
    length: int  # payload bytes (the extent is padded with zeros to 4 KiB)
    checksum: int  # XXH3-64 of the payload


class NvmeStore(BlockReadsMixin, SliceReadsMixin, NvmeCore):
    """Blocks in log-structured segment files under ``root``, one store per directory.

    Visibility and durability: a block is readable (``get``, ``in``) once ``put`` returns.
    ``flush()`` returns once every block put before it is durable: the segment files are
    fdatasync'ed, then the index records of those blocks are appended to the journal and
    fsync'ed. A crash loses at most what was put after the last flush; it never exposes a torn
    or unwritten block, since records are written only after their data and every read checks
    checksums. ``close()`` flushes and snapshots the index; reopening the directory finds every
    block that was flushed.

    Reads verify on every access: the block checksum on whole-block reads, the 128 KiB chunk
    checksums on slice reads (``read_runs``). A mismatch is a miss: the block is quarantined
    (removed, counted in ``stats().quarantined``) and never returned.

    ``put``, ``get_into``, ``get_many`` and ``get_many_into`` move bytes straight between the
    caller's buffer and the disk when the buffer is page-aligned, and through a fixed-size
    staging buffer when it is not. All methods are thread-safe; I/O runs outside the store
    lock. See ``NvmeCore`` for the constructor's arguments, capacity, eviction and compaction.
    """

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: bytes, data: Buffer, parent: bytes | None = None, tag: str = "") -> bool:
        """Store a block; ``tag`` (a namespace id) is kept with it across reopen."""
        key = check_key(key)
        parent = None if parent is None else check_key(parent)
        check_tag(tag)
        view = as_bytes_view(data)
        n = view.nbytes
        if n > self._block_bytes or extent_bytes(n) > self._capacity:
            raise BlockTooLargeError(
                f"block of {n} bytes (extent {extent_bytes(n)}) exceeds block_bytes "
                f"{self._block_bytes} or capacity {self._capacity}"
            )
        with self._op():
            reserved = self._reserve(key, extent_bytes(n))
            if reserved is None:
                return False
            seg, offset = reserved
            entry = None
            try:
                checksum, sums = self._write_extent(view, seg, offset)
                entry = BlockEntry(key, parent, seg.id, offset, n, checksum, sums, tag=tag)
            finally:
                self._finish_put(key, seg, extent_bytes(n), entry)
        return True

    def put_many(
        self, items: Sequence[PutItem]
    ) -> list[bool]:
        """``put`` of every (key, data, parent[, tag]), with the writes of all blocks in flight.

        Page-aligned blocks go to the disk together (the engine keeps ``queue_depth`` I/Os in
        flight across them); any other block is put on its own. Each block is readable once
        this returns; a block whose write fails is not stored and its error is raised after
        the others are settled. Returns, per item, whether it was stored (False: already there).
        """
        checked = []
        for item in items:
            key, data, parent = item[0], item[1], item[2]
            tag = item[3] if len(item) > 3 else ""  # type: ignore[misc]
            check_tag(tag)
            view = as_bytes_view(data)
            if view.nbytes > self._block_bytes or extent_bytes(view.nbytes) > self._capacity:
                raise BlockTooLargeError(
                    f"block of {view.nbytes} bytes exceeds block_bytes {self._block_bytes} "
                    f"or capacity {self._capacity}"
                )
            checked.append((check_key(key), view, None if parent is None else check_key(parent),
                            tag))
        done = [False] * len(checked)
        direct = [i for i, (_, v, _, _) in enumerate(checked)
                  if is_aligned(v) and v.nbytes % ALIGN == 0 and v.nbytes]
        for i in sorted(set(range(len(checked))) - set(direct)):
            done[i] = self.put(*checked[i])
        with self._op():
            writes: list[tuple[int, Segment, int, IoBatch]] = []
            failure: BaseException | None = None
            try:
                for i in direct:
                    key, view, _, _ = checked[i]
                    reserved = self._reserve(key, view.nbytes)
                    if reserved is None:
                        continue
                    seg, offset = reserved
                    try:
                        batch = self._engine.submit_write([(seg.fd, offset, view)])
                    except BaseException:
                        self._finish_put(key, seg, view.nbytes, None)
                        raise
                    writes.append((i, seg, offset, batch))
            finally:
                for i, seg, offset, batch in writes:  # settle every write, even after a failure
                    key, view, parent, tag = checked[i]
                    entry = None
                    try:
                        if failure is None:
                            batch.wait_started()
                            checksum, sums = self._sums(view)
                        batch.wait()
                        if failure is None:
                            entry = BlockEntry(key, parent, seg.id, offset, view.nbytes,
                                               checksum, sums, tag=tag)
                    except BaseException as exc:
                        failure = failure or exc
                    finally:
                        self._finish_put(key, seg, view.nbytes, entry)
                        done[i] = entry is not None
            if failure is not None:
                raise failure
        return done

    def _write_extent(self, view: np.ndarray, seg: Segment, offset: int) -> tuple[int, bytes]:
        """Write ``view`` padded to its extent at ``offset``; return its checksums.

        The checksums are computed while the last write is in flight.
        """
        n = view.nbytes
        ext = extent_bytes(n)
        direct = n // ALIGN * ALIGN if is_aligned(view) else 0
        batches: list[IoBatch] = []
        try:
            if direct:
                batches.append(self._engine.submit_write([(seg.fd, offset, view[:direct])]))
            if direct == ext:
                batches[0].wait_started()
                return self._sums(view)
            with self._wstage.borrow() as buf:
                try:
                    pos = direct
                    while True:
                        k = min(buf.nbytes, ext - pos)
                        src = view[pos : min(pos + k, n)]
                        buf[: src.nbytes] = src
                        buf[src.nbytes : k] = 0
                        batch = self._engine.submit_write([(seg.fd, offset + pos, buf[:k])])
                        pos += k
                        if pos == ext:
                            batches.append(batch)
                            for b in batches:
                                b.wait_started()
                            return self._sums(view)
                        batch.wait()  # the staging buffer is refilled next round
                finally:
                    wait_all(batches)  # the buffer is lent on only once its writes are done
        finally:
            wait_all(batches)

    # -- pins and removal ----------------------------------------------------------------------

    def pin(self, key: bytes) -> bool:
        key = check_key(key)
        with self._op(), self._lock:
            if key not in self._index:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: bytes) -> None:
        key = check_key(key)
        with self._op(), self._lock:
            count = self._pins.get(key, 0)
            if count == 0:
                raise BlockStateError(f"unpin of {key.hex()[:12]}, which is not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def delete(self, key: bytes) -> bool:
        """Remove an unpinned block; False if absent. Deleting a pinned block raises."""
        key = check_key(key)
        with self._op(), self._lock:
            entry = self._index.get(key)
            if entry is None:
                return False
            if self._pins.get(key):
                raise BlockStateError(f"block {key.hex()[:12]} is pinned {self._pins[key]}x")
            self._remove(entry)
            return True

    # -- questions -----------------------------------------------------------------------------

    def locate(self, key: bytes) -> NvmeLocation | None:
        """Where a committed block lies on disk (for tools and tests), or None."""
        key = check_key(key)
        with self._op(), self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            return NvmeLocation(self._segs.path(entry.seg), entry.offset, entry.length,
                                entry.checksum)

    def tag_of(self, key: bytes) -> str | None:
        """The tag a committed block was stored with ("" for none), or None if absent."""
        with self._op(), self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.tag

    def delete_tagged(self, tag: str) -> int:
        """Remove every unpinned block stored with ``tag`` (a namespace drop); the count.
        Durable, like every removal, once ``flush()`` returns."""
        check_tag(tag)
        if not tag:
            raise ValueError("delete_tagged needs a non-empty tag")
        with self._op(), self._lock:
            gone = [e for e in self._index.values() if e.tag == tag and not self._pins.get(e.key)]
            for entry in gone:
                self._remove(entry)
            return len(gone)

    def __contains__(self, key: object) -> bool:
        with self._op(), self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._op(), self._lock:
            return len(self._index)

    def keys(self) -> Iterable[BlockHash]:
        with self._op(), self._lock:
            return [BlockHash(k) for k in self._index]
