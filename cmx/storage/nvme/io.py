"""I/O engines: batched positional reads and writes of page-aligned buffers; the interface and
the thread pool's engine (NIXL's: ``nixl_io``; one by name: ``engines``).

Protocol, in call order:

1. ``register_file(fd)`` once per file before any I/O on it; ``unregister_file(fd)`` before the
   file is closed.
2. ``submit_write(requests)`` / ``submit_read(requests)`` with requests ``(fd, offset, view)``:
   the view a page-aligned uint8 array whose length, like the offset, is a multiple of 4 KiB.
   Each request is split into pieces of at most ``io_bytes``; pieces run ``queue_depth`` at a time.
   The call returns an ``IoBatch`` at once; the caller must not touch the buffers until
3. ``batch.wait()`` returns. It waits for every piece, even after one failed, and then raises
   ``OSError`` for the first failure, so buffers are never reused under a running I/O.

``write``/``read`` are submit + wait. Engines count the size of every I/O they issue.
"""

from __future__ import annotations

import errno
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from cmx.buffers import ALIGN
from cmx.storage.nvme.errors import StoreIOError
from cmx.storage.nvme.files import FileOps

__all__ = [
    "IoBatch",
    "IoEngine",
    "IoRequest",
    "ThreadIoEngine",
    "wait_all",
]

IoRequest = tuple[int, int, np.ndarray]  # (fd, file offset, page-aligned uint8 view)


class IoBatch(ABC):
    @abstractmethod
    def wait(self) -> None:
        """Return once every piece is done; raise OSError if any failed."""

    def wait_started(self) -> None:  # noqa: B027 - engines that post at submit need nothing
        """Return once the first ``queue_depth`` pieces are issued to the kernel.

        Call it before CPU work meant to overlap the I/O (checksums): Python code holding the
        GIL would otherwise keep pool threads from even starting their system calls.
        """


class IoEngine(ABC):
    """See the module docstring for the protocol."""

    name: ClassVar[str]

    def __init__(self, queue_depth: int = 16, io_bytes: int = 4 << 20) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if io_bytes < ALIGN or io_bytes % ALIGN:
            raise ValueError(f"io_bytes must be a positive multiple of {ALIGN}, got {io_bytes}")
        self.queue_depth = queue_depth
        self.io_bytes = io_bytes
        self._sizes: dict[str, dict[int, int]] = {"read": {}, "write": {}}
        self._sizes_lock = threading.Lock()

    # -- the mechanism -------------------------------------------------------------------------

    def register_file(self, fd: int) -> None:  # noqa: B027 - optional hook
        """Make ``fd`` usable for I/O (a no-op unless the engine needs it)."""

    def unregister_file(self, fd: int) -> None:  # noqa: B027 - optional hook
        """Forget ``fd``; call before closing it."""

    def submit_write(self, requests: Sequence[IoRequest]) -> IoBatch:
        return self._submit("write", self._split("write", requests))

    def submit_read(self, requests: Sequence[IoRequest]) -> IoBatch:
        return self._submit("read", self._split("read", requests))

    def write(self, requests: Sequence[IoRequest]) -> None:
        self.submit_write(requests).wait()

    def read(self, requests: Sequence[IoRequest]) -> None:
        self.submit_read(requests).wait()

    def io_sizes(self, op: str) -> dict[int, int]:
        """Count of issued I/Os by size bucket (the next power of two >= the size), ascending."""
        with self._sizes_lock:
            return dict(sorted(self._sizes[op].items()))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources; no I/O may follow."""

    def _split(self, op: str, requests: Sequence[IoRequest]) -> list[IoRequest]:
        pieces: list[IoRequest] = []
        for fd, offset, buf in requests:
            n = buf.nbytes
            if offset % ALIGN or n % ALIGN or buf.ctypes.data % ALIGN:
                raise ValueError(
                    f"unaligned I/O: offset {offset}, length {n}, address {buf.ctypes.data:#x}"
                )
            for start in range(0, n, self.io_bytes):
                pieces.append((fd, offset + start, buf[start : start + self.io_bytes]))
        with self._sizes_lock:
            sizes = self._sizes[op]
            for _, _, piece in pieces:
                bucket = 1 << (piece.nbytes - 1).bit_length()
                sizes[bucket] = sizes.get(bucket, 0) + 1
        return pieces

    # -- the hook an engine fills --------------------------------------------------------------

    @abstractmethod
    def _submit(self, op: str, pieces: list[IoRequest]) -> IoBatch:
        """Start ``pieces`` (each at most io_bytes) and return their batch."""


class _ThreadBatch(IoBatch):
    """Pieces of one submission; the last piece to finish sets ``_done``.

    A wait is bounded by progress: a batch none of whose pieces finished for ``stall_s`` has
    stalled (a disk that stopped answering), and its wait raises ETIMEDOUT instead of hanging.
    """

    stall_s: ClassVar[float] = 120.0

    def __init__(self, pieces: int, first_wave: int) -> None:
        self._remaining = pieces
        self._first_wave = first_wave
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = threading.Semaphore(0)
        if not pieces:
            self._done.set()

    def _finished(self, error: BaseException | None) -> None:
        with self._lock:
            self._remaining -= 1
            if error is not None and self._error is None:
                self._error = error
            if not self._remaining:
                self._done.set()

    def wait_started(self) -> None:
        while self._first_wave:
            self._started.acquire()
            self._first_wave -= 1

    def wait(self) -> None:
        with self._lock:
            seen = self._remaining
        while not self._done.wait(self.stall_s):
            with self._lock:
                left = self._remaining
            if left == seen:
                raise StoreIOError(errno.ETIMEDOUT, f"no I/O of the batch finished in "
                                   f"{self.stall_s:g} s ({left} pieces left)")
            seen = left
        if self._error is not None:
            raise self._error


class ThreadIoEngine(IoEngine):
    """``queue_depth`` threads issuing os.pwritev/os.preadv; the GIL is released in the call.

    A plain queue and daemon threads rather than an executor: per piece it costs a few
    microseconds instead of a future, which shows between the blocks of a put loop.
    """

    name = "threads"

    def __init__(self, queue_depth: int = 16, io_bytes: int = 4 << 20,
                 files: FileOps | None = None) -> None:
        super().__init__(queue_depth, io_bytes)
        self._files = files or FileOps()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"cmx-nvme-io-{i}", daemon=True)
            for i in range(queue_depth)
        ]
        for thread in self._threads:
            thread.start()

    def _submit(self, op: str, pieces: list[IoRequest]) -> IoBatch:
        fn = self._files.pwrite_all if op == "write" else self._files.pread_all
        batch = _ThreadBatch(len(pieces), min(len(pieces), self.queue_depth))
        for fd, off, buf in pieces:
            self._queue.put((batch, fn, fd, off, buf))
        return batch

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, fn, fd, off, buf = item
            batch._started.release()
            try:
                fn(fd, memoryview(buf), off)
            except BaseException as exc:  # handed to the waiter
                batch._finished(exc)
            else:
                batch._finished(None)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


def wait_all(batches: list[IoBatch]) -> None:
    """Wait for every batch, then raise the first failure."""
    first: BaseException | None = None
    while batches:
        try:
            batches.pop(0).wait()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
