"""Writes of the NVMe store: one block, or many with their writes in flight at once.

A write is the books' two phases around the data plane's bytes: ``books.reserve``, then
``io.write`` (or a direct submission of a page-aligned buffer), then ``books.commit`` with the
checksums, or ``books.abort`` if the write failed. Nothing else is shared.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmx.buffers import ALIGN, Buffer, as_bytes_view, is_aligned
from cmx.errors import BlockTooLargeError
from cmx.keys import check_key
from cmx.storage.nvme.books import NvmeBooks, Reservation
from cmx.storage.nvme.chunks import block_sums, extent_bytes
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.io import IoBatch
from cmx.storage.nvme.records import check_tag

__all__ = ["PutItem", "Writer"]

# (key, data, parent) or (key, data, parent, tag)
PutItem = tuple[bytes, Buffer, bytes | None] | tuple[bytes, Buffer, bytes | None, str]
_Checked = tuple[bytes, np.ndarray, bytes | None, str]


class Writer:
    def __init__(self, books: NvmeBooks, io: ExtentIo, block_bytes: int) -> None:
        self._books = books
        self._io = io
        self._block_bytes = block_bytes

    def check(self, key: bytes, data: Buffer, parent: bytes | None, tag: str) -> _Checked:
        """Validate one block before anything changes."""
        view = as_bytes_view(data)
        n = view.nbytes
        if n > self._block_bytes or extent_bytes(n) > self._books.capacity:
            raise BlockTooLargeError(
                f"block of {n} bytes (extent {extent_bytes(n)}) exceeds block_bytes "
                f"{self._block_bytes} or capacity {self._books.capacity}"
            )
        check_tag(tag)
        return check_key(key), view, None if parent is None else check_key(parent), tag

    def put(self, key: bytes, view: np.ndarray, parent: bytes | None, tag: str) -> bool:
        books = self._books
        r = books.reserve(key, view.nbytes, parent, tag)
        if r is None:
            return False
        try:
            checksum, sums = self._io.write(r.seg.fd, r.offset, view)
        except BaseException:
            books.abort(r)
            raise
        books.commit(r, checksum, sums)
        return True

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        checked = [self.check(i[0], i[1], i[2], i[3] if len(i) > 3 else "")
                   for i in items]
        done = [False] * len(checked)
        direct = [i for i, (_, v, _, _) in enumerate(checked)
                  if is_aligned(v) and v.nbytes % ALIGN == 0 and v.nbytes]
        for i in sorted(set(range(len(checked))) - set(direct)):
            done[i] = self.put(*checked[i])
        writes: list[tuple[int, Reservation, IoBatch]] = []
        failure: BaseException | None = None
        try:
            for i in direct:
                key, view, parent, tag = checked[i]
                r = self._books.reserve(key, view.nbytes, parent, tag)
                if r is None:
                    continue
                try:
                    batch = self._io.submit_write([(r.seg.fd, r.offset, view)])
                except BaseException:
                    self._books.abort(r)
                    raise
                writes.append((i, r, batch))
        finally:
            for i, r, batch in writes:  # settle every write, even after a failure
                failure = self._settle(checked[i][1], r, batch, failure)
                done[i] = failure is None
        if failure is not None:
            raise failure
        return done

    def _settle(self, view: np.ndarray, r: Reservation, batch: IoBatch,
                failure: BaseException | None) -> BaseException | None:
        """Wait for one direct write and commit it (abort it after any failure)."""
        sums = None
        try:
            if failure is None:
                batch.wait_started()  # hash while the write is in flight
                sums = block_sums(view)
            batch.wait()
        except BaseException as exc:
            failure = failure or exc
        if failure is None and sums is not None:
            self._books.commit(r, *sums)
        else:
            self._books.abort(r)
        return failure
