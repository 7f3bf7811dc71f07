"""ExtentIo: the bytes of the NVMe store, moved between caller buffers and segment extents.

It owns the I/O engine and the two staging buffers, and nothing of the books: it is told a
file descriptor, an offset and a buffer, and moves the bytes with many I/Os in flight. The
control plane (``NvmeBooks``) decides where an extent lies; this part only writes and reads
it. That split is what lets the service run the books in one process and the bytes in
another (the node's data plane) with exactly these parts.

Buffers that are page-aligned go straight to and from the disk (O_DIRECT); any other is
copied through a fixed-size staging buffer in rounds, so staging memory stays bounded.
"""

from __future__ import annotations

import numpy as np

from cmx.buffers import ALIGN, is_aligned
from cmx.checksum import checksum
from cmx.storage.nvme.chunks import block_sums, extent_bytes
from cmx.storage.nvme.io import IoBatch, IoEngine, IoRequest, wait_all
from cmx.storage.nvme.staging import Staging, alloc_aligned

__all__ = ["ExtentIo"]


class ExtentIo:
    def __init__(self, engine: IoEngine, staging_bytes: int) -> None:
        self.engine = engine
        self._wstage, self._rstage = Staging(staging_bytes), Staging(staging_bytes)
        self._cbuf: np.ndarray | None = None  # compaction's copy buffer (one copy at a time)

    @property
    def queue_depth(self) -> int:
        return self.engine.queue_depth

    @property
    def io_bytes(self) -> int:
        return self.engine.io_bytes

    # -- writes --------------------------------------------------------------------------------

    def write(self, fd: int, offset: int, view: np.ndarray) -> tuple[int, bytes]:
        """Write ``view`` padded to its extent at ``offset``; return its checksums (block,
        chunks), computed while the last write is in flight."""
        n = view.nbytes
        ext = extent_bytes(n)
        direct = n // ALIGN * ALIGN if is_aligned(view) else 0
        batches: list[IoBatch] = []
        try:
            if direct:
                batches.append(self.engine.submit_write([(fd, offset, view[:direct])]))
            if direct == ext:
                batches[0].wait_started()
                return block_sums(view)
            with self._wstage.borrow() as buf:
                try:
                    pos = direct
                    while True:
                        k = min(buf.nbytes, ext - pos)
                        src = view[pos : min(pos + k, n)]
                        buf[: src.nbytes] = src
                        buf[src.nbytes : k] = 0
                        batch = self.engine.submit_write([(fd, offset + pos, buf[:k])])
                        pos += k
                        if pos == ext:
                            batches.append(batch)
                            for b in batches:
                                b.wait_started()
                            return block_sums(view)
                        batch.wait()  # the staging buffer is refilled next round
                finally:
                    wait_all(batches)  # the buffer is lent on only once its writes are done
        finally:
            wait_all(batches)

    def submit_write(self, requests: list[IoRequest]) -> IoBatch:
        """Start writes of page-aligned buffers (whole extents); the caller waits."""
        return self.engine.submit_write(requests)

    # -- reads ---------------------------------------------------------------------------------

    def read_into(self, fd: int, offset: int, length: int, dst: np.ndarray) -> None:
        """Read the ``length``-byte block at ``offset`` into ``dst[:length]``; bytes past it
        are left alone (the extent's tail goes through staging)."""
        ext = extent_bytes(length)
        direct = length // ALIGN * ALIGN if is_aligned(dst) else 0
        batches = []
        try:
            if direct:
                batches.append(self.engine.submit_read([(fd, offset, dst[:direct])]))
            if direct < ext:
                with self._rstage.borrow() as buf:
                    for pos in range(direct, ext, buf.nbytes):
                        k = min(buf.nbytes, ext - pos)
                        self.engine.read([(fd, offset + pos, buf[:k])])
                        take = max(0, min(k, length - pos))
                        dst[pos : pos + take] = buf[:take]
        finally:
            wait_all(batches)

    def submit_read(self, requests: list[IoRequest]) -> IoBatch:
        return self.engine.submit_read(requests)

    def read(self, requests: list[IoRequest]) -> None:
        self.engine.read(requests)

    # -- compaction ----------------------------------------------------------------------------

    def load_checked(self, fd: int, offset: int, length: int, expect: int) -> np.ndarray | None:
        """The whole extent at ``offset`` in a reused buffer if its payload matches
        ``expect``, else None; for a copy to ``store`` (one copy at a time)."""
        ext = extent_bytes(length)
        if self._cbuf is None or self._cbuf.nbytes < ext:
            self._cbuf = alloc_aligned(max(ext, self._wstage.nbytes))
        buf = self._cbuf[:ext]
        self.engine.read([(fd, offset, buf)])
        return buf if checksum(buf[:length]) == expect else None

    def store(self, fd: int, offset: int, extent: np.ndarray) -> None:
        self.engine.write([(fd, offset, extent)])

    def close(self) -> None:
        self.engine.close()
