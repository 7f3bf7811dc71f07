"""The service's NVMe path without Ray, for suite "nvme": ExtentBooks decide, ExtentPlane moves.

What the NVMe tier actor (books) and the node's agent (bytes) do for a store with
write-through and for a load, in one process: ``reserve_extent`` of every block,
``ExtentPlane.write_many`` of their windows, ``commit_extent`` and ``flush``; then ``pin`` +
``entry_of``, ``ExtentPlane.read_many`` into arena-like slots, ``unpin``. Segments are the
service's default size. The gap between these
figures and the service's own (suite "service") is the cost of the actors around them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from cmx.bench.harness.core import GB, BenchContext, timed
from cmx.buffers import aligned_empty
from cmx.config import ServiceConfig
from cmx.keys import BlockHash
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.storage.nvme.extents import ExtentBooks

__all__ = ["plane_pass"]

WINDOW_BYTES = 256 << 20  # blocks per write or read call: what one agent call moves at most


def _write_all(books: ExtentBooks, plane: ExtentPlane, keys: list[BlockHash],
               pool: list[np.ndarray], per_call: int) -> None:
    for start in range(0, len(keys), per_call):
        batch = keys[start : start + per_call]
        srcs = [pool[(start + i) % len(pool)] for i in range(len(batch))]
        pend = [books.reserve_extent(k, None, s.nbytes) for k, s in zip(batch, srcs)]
        if any(p is None for p in pend):
            raise AssertionError("a fresh key was refused")
        exts = [Extent(p.key, p.path, p.offset, p.size) for p in pend if p is not None]
        for p, (whole, sums) in zip(pend, plane.write_many(exts, srcs)):
            assert p is not None
            books.commit_extent(p, whole, sums)
    books.flush()


def _read_all(books: ExtentBooks, plane: ExtentPlane, keys: list[BlockHash],
              slots: list[np.ndarray]) -> None:
    for start in range(0, len(keys), len(slots)):
        batch = keys[start : start + len(slots)]
        exts = []
        for k in batch:
            if not books.pin(k):
                raise AssertionError("a stored block is gone")
            e = books.entry_of(k)
            assert e is not None
            exts.append(Extent(k, books.segment_path(e.seg), e.offset, e.length, e.checksum))
        try:
            if not all(plane.read_many(exts, slots[: len(exts)])):
                raise AssertionError("a block failed its checksum")
        finally:
            for k in batch:
                books.unpin(k)


def plane_pass(ctx: BenchContext, root: Path, block_bytes: int, keys: list[BlockHash],
               pool: list[np.ndarray]) -> dict[str, float]:
    """GB/s of writing then reading ``keys`` the way the service does, in a fresh store: the
    unit of every other rate of the ``nvme`` suite, beside which they are judged."""
    total = len(keys) * block_bytes
    per_call = max(1, WINDOW_BYTES // block_bytes)
    books = ExtentBooks(root, 2 * total + block_bytes, block_bytes,
                        segment_bytes=max(ServiceConfig().nvme_segment_bytes, block_bytes))
    plane = ExtentPlane()
    try:
        rates = {"plane_write": total / timed(
            lambda: _write_all(books, plane, keys, pool, per_call))}
        arena = aligned_empty(per_call * block_bytes)
        arena[:] = 0  # faulted in, as an arena is
        slots = [arena[i * block_bytes : (i + 1) * block_bytes] for i in range(per_call)]
        ctx.drop_cache()
        rates["plane_read"] = total / timed(lambda: _read_all(books, plane, keys, slots))
        books.check_integrity()
        return {k: v / GB for k, v in rates.items()}
    finally:
        plane.close()
        books.close()
        shutil.rmtree(root, ignore_errors=True)
