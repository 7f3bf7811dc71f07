"""What a store in front of ``NvmeBooks`` answers the same way, whichever moves its bytes.

``NvmeStore`` (the library's store: books and its own reader and writer) and ``ExtentBooks``
(the service's books, whose bytes the node's data plane moves) each hold one over their
``books`` and the ``io`` that registers their segment files, and answer those calls with it:
membership, stats, integrity, flush and close are the books' own, under the books' operation
guard.
"""

from __future__ import annotations

from cmx.keys import BlockHash
from cmx.storage.base import NvmeStats
from cmx.storage.nvme.books import NvmeBooks
from cmx.storage.nvme.extentio import ExtentIo

__all__ = ["BooksFront"]


class BooksFront:
    def __init__(self, books: NvmeBooks, io: ExtentIo) -> None:
        self.books = books
        self.io = io  # closed with the books

    def __contains__(self, key: object) -> bool:
        with self.books.op(), self.books.lock:
            return key in self.books.index

    def __len__(self) -> int:
        with self.books.op(), self.books.lock:
            return len(self.books.index)

    def keys(self) -> list[BlockHash]:
        with self.books.op(), self.books.lock:
            return [BlockHash(k) for k in self.books.index]

    def stats(self) -> NvmeStats:
        with self.books.op():
            return self.books.stats()

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if index, segments, files or policy disagree."""
        with self.books.op():
            self.books.check_integrity()

    def flush(self) -> None:
        with self.books.op():
            self.books.flush()

    def close(self) -> None:
        """Flush, snapshot the index and release files, engine and directory lock. Idempotent."""
        try:
            self.books.close()
        finally:
            self.io.close()
