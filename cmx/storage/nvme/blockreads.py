"""Whole-block reads of the NVMe store: one block, or a prefix with many reads in flight.

Each read is ``books.lookup`` (entry and an I/O reference on its segment), the bytes through
``ExtentIo``, then ``books.release`` and ``books.verified`` (hit, or miss and quarantine).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from cmx.buffers import Buffer, as_bytes_view, is_aligned
from cmx.checksum import checksum
from cmx.keys import check_key
from cmx.storage.nvme.books import NvmeBooks
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.io import IoBatch
from cmx.storage.nvme.segments import Segment
from cmx.storage.nvme.staging import alloc_aligned

__all__ = ["BlockReader"]

Finish = Callable[[int, BlockEntry, np.ndarray, bool], None]


class BlockReader:
    def __init__(self, books: NvmeBooks, io: ExtentIo) -> None:
        self._books = books
        self._io = io

    def _verified(self, entry: BlockEntry, payload: np.ndarray) -> bool:
        return self._books.verified(entry, checksum(payload) == entry.checksum)

    def get(self, key: bytes) -> np.ndarray | None:
        key = check_key(key)
        found = self._books.lookup(key)
        if found is None:
            return None
        entry, seg = found
        try:
            out = alloc_aligned(entry.extent)
            self._io.read([(seg.fd, entry.offset, out)])
        finally:
            self._books.release(seg)
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
        found = self._books.lookup(key, min_room=dst.nbytes)
        if found is None:
            return False
        entry, seg = found
        try:
            self._io.read_into(seg.fd, entry.offset, entry.length, dst)
        finally:
            self._books.release(seg)
        return self._verified(entry, dst[: entry.length])

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Blocks of ``keys`` (None for each miss), with reads of many blocks in flight at once.

        Reads are submitted ahead up to ``queue_depth x io_bytes`` bytes (at least one block);
        each block is verified while later ones are still being read.
        """
        results: list[np.ndarray | None] = [None] * len(keys)

        def land(i: int, entry: BlockEntry) -> tuple[np.ndarray, bool]:
            return alloc_aligned(entry.extent), True

        def finish(i: int, entry: BlockEntry, payload: np.ndarray, ok: bool) -> None:
            results[i] = payload if ok else None

        self._read_many(keys, land, finish)
        return results

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[bool]:
        """``get_into`` of each key into its buffer, with reads of many blocks in flight at once.

        The loader's call: a prefix into its arena slots. A block whose length is a multiple of
        4 KiB (every KV block) lands in a page-aligned buffer straight from the disk, with the
        reads of many blocks in flight; any other is read at once, its tail through staging, so
        bytes past a block are left alone. A buffer smaller than its block raises ValueError.
        """
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        dsts = [as_bytes_view(out) for out in outs]
        if not all(dst.flags.writeable for dst in dsts):
            raise ValueError("get_many_into needs writable buffers")
        hits = [False] * len(keys)

        def land(i: int, entry: BlockEntry) -> tuple[np.ndarray, bool]:
            dst = dsts[i]
            if dst.nbytes < entry.length:
                raise ValueError(f"buffer of {dst.nbytes} bytes < block of {entry.length}")
            return dst, is_aligned(dst) and entry.length == entry.extent

        def finish(i: int, entry: BlockEntry, payload: np.ndarray, ok: bool) -> None:
            hits[i] = ok

        self._read_many(keys, land, finish)
        return hits

    def _read_many(
        self,
        keys: Sequence[bytes],
        land: Callable[[int, BlockEntry], tuple[np.ndarray, bool]],
        finish: Finish,
    ) -> None:
        """Read every present key; ``land`` gives each block's buffer and whether the disk can
        fill it directly (else it is read through staging at once), ``finish`` takes each
        block's payload once verified (ok False: it failed its checksum and is gone)."""
        checked = [check_key(k) for k in keys]
        window = self._io.queue_depth * self._io.io_bytes
        inflight: deque[tuple[int, BlockEntry, Segment, np.ndarray, IoBatch]] = deque()
        inflight_bytes = 0
        try:
            for i, key in enumerate(checked):
                found = self._books.lookup(key)
                if found is None:
                    continue
                entry, seg = found
                try:
                    out, direct = land(i, entry)
                    if not direct:
                        self._io.read_into(seg.fd, entry.offset, entry.length, out)
                    else:
                        io = (seg.fd, entry.offset, out[: entry.extent])
                        batch = self._io.submit_read([io])
                except BaseException:
                    self._books.release(seg)
                    raise
                if not direct:
                    self._books.release(seg)
                    payload = out[: entry.length]
                    finish(i, entry, payload, self._verified(entry, payload))
                    continue
                batch.wait_started()  # before verifying earlier blocks holds the GIL
                inflight.append((i, entry, seg, out, batch))
                inflight_bytes += entry.extent
                while inflight and inflight_bytes > window:
                    inflight_bytes -= self._finish_one(inflight.popleft(), finish)
            while inflight:
                self._finish_one(inflight.popleft(), finish)
        finally:
            for _, _, seg, _, batch in inflight:  # only after a failure
                try:
                    batch.wait()
                except OSError:
                    pass
                self._books.release(seg)

    def _finish_one(self, item, finish: Finish) -> int:
        i, entry, seg, out, batch = item
        try:
            batch.wait()
        finally:
            self._books.release(seg)
        payload = out[: entry.length]
        finish(i, entry, payload, self._verified(entry, payload))
        return entry.extent
