"""Reading a selection's bytes out of one verified copy of a block: in memory, or on NVMe.

Both are the source side of a partial load (``cmx.selection`` says how it is verified): the
copy is checked before it is sliced, so the bytes handed on are the committed ones.

- ``slice_memory``: a copy in an arena slot is checked whole against its block checksum (the
  only checksum memory tiers keep; memory reads at several GB/s), then sliced.
- ``ExtentSlices``: a copy on NVMe is read as the 128 KiB chunks that cover the runs, planned
  into few large I/Os (``cmx.storage.nvme.reads.plan_reads``, the plan the store's own slice
  reads use), and each chunk is checked against the chunk checksums stored with the block.
  An extent without chunk checksums is read whole and checked against the block checksum.
"""

from __future__ import annotations

import numpy as np
import xxhash

from cmx.checksum import checksum
from cmx.selection import Runs, gather, runs_bytes
from cmx.storage.nvme.chunks import CHUNK_BYTES, chunk_count, extent_bytes
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.storage.nvme.reads import plan_reads
from cmx.storage.nvme.staging import alloc_aligned

__all__ = ["ExtentSlices", "slice_memory"]

MAX_IO = 4 << 20  # bytes per I/O: large enough to run at the disk's sequential speed


def slice_memory(payload: np.ndarray, want: int, runs: Runs) -> np.ndarray | None:
    """The ``runs`` of ``payload`` (one block's committed bytes), or None if the payload does
    not match its checksum ``want``."""
    if checksum(payload) != want:
        return None
    return gather(payload, runs)


class ExtentSlices:
    """Selections read from NVMe extents through ``io`` (an agent's or a pool node's)."""

    def __init__(self, io: ExtentPlane, max_io: int = MAX_IO) -> None:
        self.io = io
        self.max_io = max_io

    def read(self, ext: Extent, runs: Runs, out: np.ndarray | None = None) -> np.ndarray | None:
        """The ``runs`` of the block at ``ext`` (gathered into ``out`` if given), or None if
        a chunk read fails its checksum (the caller quarantines the copy)."""
        sums = np.frombuffer(ext.chunk_sums, dtype="<u8")
        if len(sums) != chunk_count(ext.size):
            return self._read_whole(ext, runs, out)
        size = extent_bytes(ext.size)
        spans = []
        for off, length in runs:
            c0, c1 = off // CHUNK_BYTES, -(-(off + length) // CHUNK_BYTES)
            spans.append((0, ext.offset + c0 * CHUNK_BYTES,
                          ext.offset + min(c1 * CHUNK_BYTES, size)))
        plan = plan_reads(spans, runs_bytes(runs), max_io=self.max_io)
        buf = alloc_aligned(plan.nbytes)
        self.io.read_at(ext.path, [(pos, buf[at : at + n]) for _, pos, n, at in plan.ios])
        checked: set[int] = set()
        for off, length in runs:
            for c in range(off // CHUNK_BYTES, -(-(off + length) // CHUNK_BYTES)):
                if c in checked:
                    continue
                checked.add(c)
                start = c * CHUNK_BYTES
                at = plan.locate(0, ext.offset + start)
                n = min(CHUNK_BYTES, size - start)
                if xxhash.xxh3_64_intdigest(buf[at : at + n].data) != int(sums[c]):
                    return None
        dst = np.empty(runs_bytes(runs), np.uint8) if out is None else out[: runs_bytes(runs)]
        pos = 0
        for off, length in runs:
            at = plan.locate(0, ext.offset + off)
            dst[pos : pos + length] = buf[at : at + length]
            pos += length
        return dst

    def _read_whole(self, ext: Extent, runs: Runs,
                    out: np.ndarray | None = None) -> np.ndarray | None:
        buf = alloc_aligned(extent_bytes(ext.size))
        self.io.read_many([ext], [buf])  # checked below, against the runs
        payload = buf[: ext.size]
        if checksum(payload) != ext.checksum:
            return None
        return gather(payload, runs, out)
