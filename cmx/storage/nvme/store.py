"""NvmeStore: the public surface of the local NVMe tier (slice reads in slices.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cmx.buffers import ALIGN, Buffer, as_bytes_view, is_aligned
from cmx.errors import BlockStateError, BlockTooLargeError
from cmx.keys import BlockHash, check_key
from cmx.storage.nvme.chunks import extent_bytes
from cmx.storage.nvme.core import NvmeCore
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.io import IoBatch
from cmx.storage.nvme.segments import Segment
from cmx.storage.nvme.slices import SliceReadsMixin
from cmx.storage.nvme.staging import alloc_aligned

__all__ = ["NvmeLocation", "NvmeStore"]


@dataclass(frozen=True)
class NvmeLocation:
    path: str  # segment file
    offset: int  # of the extent in the file, 4 KiB-aligned
    length: int  # payload bytes (the extent is padded with zeros to 4 KiB)
    checksum: int  # XXH3-64 of the payload


class NvmeStore(SliceReadsMixin, NvmeCore):
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

    ``put``, ``get_into`` and ``get_many`` move bytes straight between the caller's buffer and
    the disk when the buffer is page-aligned, and through a fixed-size staging buffer when it
    is not. All methods are thread-safe; I/O runs outside the store lock. See ``NvmeCore`` for
    the constructor's arguments, capacity, eviction and compaction.
    """

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: bytes, data: Buffer, parent: bytes | None = None) -> bool:
        key = check_key(key)
        parent = None if parent is None else check_key(parent)
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
                entry = BlockEntry(key, parent, seg.id, offset, n, checksum, sums)
            finally:
                self._finish_put(key, seg, extent_bytes(n), entry)
        return True

    def put_many(
        self, items: Sequence[tuple[bytes, Buffer, bytes | None]]
    ) -> list[bool]:
        """``put`` of every (key, data, parent), with the writes of all blocks in flight at once.

        Page-aligned blocks go to the disk together (the engine keeps ``queue_depth`` I/Os in
        flight across them); any other block is put on its own. Each block is readable once
        this returns; a block whose write fails is not stored and its error is raised after
        the others are settled. Returns, per item, whether it was stored (False: already there).
        """
        checked = []
        for key, data, parent in items:
            view = as_bytes_view(data)
            if view.nbytes > self._block_bytes or extent_bytes(view.nbytes) > self._capacity:
                raise BlockTooLargeError(
                    f"block of {view.nbytes} bytes exceeds block_bytes {self._block_bytes} "
                    f"or capacity {self._capacity}"
                )
            checked.append((check_key(key), view, None if parent is None else check_key(parent)))
        done = [False] * len(checked)
        direct = [i for i, (_, v, _) in enumerate(checked)
                  if is_aligned(v) and v.nbytes % ALIGN == 0 and v.nbytes]
        for i in sorted(set(range(len(checked))) - set(direct)):
            done[i] = self.put(checked[i][0], checked[i][1], checked[i][2])
        with self._op():
            writes: list[tuple[int, Segment, int, IoBatch]] = []
            failure: BaseException | None = None
            try:
                for i in direct:
                    key, view, _ = checked[i]
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
                    key, view, parent = checked[i]
                    entry = None
                    try:
                        if failure is None:
                            batch.wait_started()
                            checksum, sums = self._sums(view)
                        batch.wait()
                        if failure is None:
                            entry = BlockEntry(key, parent, seg.id, offset, view.nbytes,
                                               checksum, sums)
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
                    self._wait(batches)  # the buffer is lent on only once its writes are done
        finally:
            self._wait(batches)

    @staticmethod
    def _wait(batches: list[IoBatch]) -> None:
        """Wait for every batch, then raise the first failure."""
        first: BaseException | None = None
        while batches:
            try:
                batches.pop(0).wait()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    # -- whole-block reads ---------------------------------------------------------------------

    def get(self, key: bytes) -> np.ndarray | None:
        key = check_key(key)
        with self._op():
            found = self._lookup(key)
            if found is None:
                return None
            entry, seg = found
            try:
                out = alloc_aligned(entry.extent)
                self._engine.read([(seg.fd, entry.offset, out)])
            finally:
                self._release(seg)
            return out[: entry.length] if self._verified(entry, out[: entry.length]) else None

    def get_into(self, key: bytes, out: Buffer) -> bool:
        """Read the block into ``out[:length]``; False on a miss (``out`` then holds garbage).

        ``out`` must be writable and at least the block's length; bytes past the block are
        left alone. A page-aligned ``out`` (a shared-memory arena slot) is read into directly.
        """
        key = check_key(key)
        dst = as_bytes_view(out)
        if not dst.flags.writeable:
            raise ValueError("get_into needs a writable buffer")
        with self._op():
            found = self._lookup(key, min_room=dst.nbytes)
            if found is None:
                return False
            entry, seg = found
            try:
                self._read_into(entry, seg, dst)
            finally:
                self._release(seg)
            return self._verified(entry, dst[: entry.length])

    def _read_into(self, entry: BlockEntry, seg: Segment, dst: np.ndarray) -> None:
        n, ext = entry.length, entry.extent
        direct = n // ALIGN * ALIGN if is_aligned(dst) else 0
        batches = []
        try:
            if direct:
                batches.append(self._engine.submit_read([(seg.fd, entry.offset, dst[:direct])]))
            if direct < ext:
                with self._rstage.borrow() as buf:
                    for pos in range(direct, ext, buf.nbytes):
                        k = min(buf.nbytes, ext - pos)
                        self._engine.read([(seg.fd, entry.offset + pos, buf[:k])])
                        take = max(0, min(k, n - pos))
                        dst[pos : pos + take] = buf[:take]
        finally:
            self._wait(batches)

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Blocks of ``keys`` (None for each miss), with reads of many blocks in flight at once.

        Reads are submitted ahead up to ``queue_depth x io_bytes`` bytes (at least one block);
        each block is verified while later ones are still being read.
        """
        checked = [check_key(k) for k in keys]
        results: list[np.ndarray | None] = [None] * len(checked)
        window = self._engine.queue_depth * self._engine.io_bytes
        with self._op():
            inflight: deque[tuple[int, BlockEntry, Segment, np.ndarray, IoBatch]] = deque()
            inflight_bytes = 0
            try:
                for i, key in enumerate(checked):
                    found = self._lookup(key)
                    if found is None:
                        continue
                    entry, seg = found
                    try:
                        out = alloc_aligned(entry.extent)
                        batch = self._engine.submit_read([(seg.fd, entry.offset, out)])
                    except BaseException:
                        self._release(seg)
                        raise
                    batch.wait_started()  # before verifying earlier blocks holds the GIL
                    inflight.append((i, entry, seg, out, batch))
                    inflight_bytes += entry.extent
                    while inflight and inflight_bytes > window:
                        inflight_bytes -= self._finish_one(inflight.popleft(), results)
                while inflight:
                    self._finish_one(inflight.popleft(), results)
            finally:
                for _, _, seg, _, batch in inflight:  # only after a failure
                    try:
                        batch.wait()
                    except OSError:
                        pass
                    self._release(seg)
        return results

    def _finish_one(self, item, results: list[np.ndarray | None]) -> int:
        i, entry, seg, out, batch = item
        try:
            batch.wait()
        finally:
            self._release(seg)
        payload = out[: entry.length]
        results[i] = payload if self._verified(entry, payload) else None
        return entry.extent

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

    def __contains__(self, key: object) -> bool:
        with self._op(), self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._op(), self._lock:
            return len(self._index)

    def keys(self) -> Iterable[BlockHash]:
        with self._op(), self._lock:
            return [BlockHash(k) for k in self._index]
