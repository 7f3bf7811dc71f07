"""The agent's NVMe data path: O_DIRECT reads and writes of extents, many I/Os in flight.

Extents come from the NVMe tier (which owns allocation and the index); the agent opens the
segment files itself, so the tier's process never carries payload bytes. Each extent is split
into chunks of ``chunk_bytes`` issued through the NVMe store's I/O engine.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from cmx.buffers import align_up
from cmx.storage.nvme.io import IoEngine, make_io_engine

__all__ = ["Extent", "NvmeIo"]

MAX_OPEN_SEGMENTS = 64


@dataclass(frozen=True)
class Extent:
    """Where a block lies (or will lie) in the NVMe tier's log."""

    key: bytes
    path: str  # segment file
    offset: int  # 4 KiB-aligned
    size: int  # payload bytes; the extent on disk is align_up(size)
    checksum: int = 0  # of the payload, once committed
    lease: int = 0  # of the pin or reservation that hands it out: end it by this id
    chunk_sums: bytes = b""  # of a pinned block: XXH3-64 per 128 KiB chunk, for slice reads


class NvmeIo:
    def __init__(self, engine: str = "auto", queue_depth: int = 16) -> None:
        self.engine: IoEngine = make_io_engine(engine, queue_depth=queue_depth)
        # Open segment files, most recently used last. Bounded: a segment that compaction
        # deleted keeps its disk space until its descriptor here is closed.
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._users: dict[int, int] = {}  # descriptor -> I/Os using it now
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0

    def read(self, ext: Extent, slot: np.ndarray) -> None:
        """Read the extent into the front of ``slot`` (a page-aligned arena slot)."""
        with self._open(ext.path) as fd:
            self.engine.read([(fd, ext.offset, _front(slot, ext.size))])
        self.bytes_read += ext.size

    def read_at(self, path: str, ios: list[tuple[int, np.ndarray]]) -> None:
        """Read each (file offset, page-aligned buffer) of ``path``, all in flight at once."""
        with self._open(path) as fd:
            self.engine.read([(fd, offset, dst) for offset, dst in ios])
        self.bytes_read += sum(dst.nbytes for _, dst in ios)

    def write(self, ext: Extent, slot: np.ndarray) -> None:
        """Write the front of ``slot`` (a page-aligned arena slot) to the extent."""
        with self._open(ext.path) as fd:
            self.engine.write([(fd, ext.offset, _front(slot, ext.size))])
        self.bytes_written += ext.size

    @contextmanager
    def _open(self, path: str) -> Iterator[int]:
        """A descriptor of ``path`` held open for the duration of one I/O."""
        # Segment names are never reused, so a cached descriptor never points at another file.
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDWR | os.O_DIRECT)
                self.engine.register_file(fd)
            self._fds.move_to_end(path)
            self._users[fd] = self._users.get(fd, 0) + 1
        try:
            yield fd
        finally:
            with self._lock:
                self._users[fd] -= 1
                if not self._users[fd]:
                    del self._users[fd]
                self._trim()

    def _trim(self) -> None:
        """Close the least recently used descriptors no I/O is using, down to the bound."""
        for path in list(self._fds):
            if len(self._fds) <= MAX_OPEN_SEGMENTS:
                return
            fd = self._fds[path]
            if fd not in self._users:
                del self._fds[path]
                self.engine.unregister_file(fd)
                os.close(fd)

    def stats(self) -> dict[str, object]:
        return {
            "engine": self.engine.name,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                self.engine.unregister_file(fd)
                os.close(fd)
            self._fds.clear()
        self.engine.close()


def _front(slot: np.ndarray, size: int) -> np.ndarray:
    n = align_up(size)
    if slot.nbytes < n:
        raise ValueError(f"a slot of {slot.nbytes} bytes cannot hold an extent of {n}")
    return slot[:n]
