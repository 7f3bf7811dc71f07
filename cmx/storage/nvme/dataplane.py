"""ExtentPlane: the bytes of an NVMe store whose books live in another process.

The service runs the NVMe store split in two: the books (``NvmeBooks``, in the tier actor)
hand out ``Extent``s, pinned for a read or reserved for a write, and this part, in the
node's data plane, moves the bytes. It runs the store's own parts: ``BlockReader`` (the
reads of ``NvmeStore.get_many_into``, many blocks in flight, each verified as it lands) over
``ExtentIo`` (the I/O engine: ``queue_depth`` I/Os of up to ``io_bytes`` in flight, O_DIRECT
into page-aligned buffers, unaligned tails through bounded staging). A read or write of a
list of extents is one call, so a prefix keeps the disk's queue full.

Segment files are opened here with O_DIRECT; a filesystem that refuses it (tmpfs) gets
buffered I/O, said once in the log and kept in ``stats().direct`` (the service reports the
same fallback as degraded when it probes the directory). Descriptors stay open between calls;
one whose file was deleted since is let go, and the name opened again (a restarted tier may
have made the file anew).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from cmx.buffers import ALIGN, is_aligned
from cmx.storage.nvme.blockreads import BlockReader
from cmx.storage.nvme.chunks import block_sums, extent_bytes
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.io import IoBatch
from cmx.storage.nvme.space import ExtentMove, Mover
from cmx.storage.nvme.staging import alloc_aligned

__all__ = ["Extent", "ExtentPlane", "PlaneMover", "PlaneStats", "extent_pairs"]

log = logging.getLogger(__name__)

MAX_OPEN_SEGMENTS = 64
COPY_WINDOW = 64 << 20  # compaction's bytes in flight at once


@dataclass(frozen=True)
class Extent:
    """Where a block lies (or will lie) in an NVMe store's log, as its books hand it out."""

    key: bytes
    path: str  # segment file
    offset: int  # 4 KiB-aligned
    size: int  # payload bytes; the extent on disk is extent_bytes(size)
    checksum: int = 0  # of the payload, once committed
    lease: int = 0  # of the pin or reservation that hands it out: end it by this id
    chunk_sums: bytes = b""  # of a pinned block: XXH3-64 per 128 KiB chunk, for slice reads
    tag: str = ""  # of a pinned block: its namespace id, which copies made from it keep

    @property
    def length(self) -> int:
        return self.size

    @property
    def extent(self) -> int:
        return extent_bytes(self.size)


def extent_pairs(moves: Sequence[ExtentMove]) -> list[tuple[Extent, Extent]]:
    """Compaction's copies as (from, to) extents, for a data plane to make."""
    return [(Extent(m.entry.key, m.src.path, m.entry.offset, m.entry.length, m.entry.checksum),
             Extent(m.entry.key, m.dst.path, m.dst_offset, m.entry.length, m.entry.checksum))
            for m in moves]


class PlaneMover(Mover):
    """Compaction's copies made by an ExtentPlane in this process (a pool node's own)."""

    def __init__(self, plane: ExtentPlane) -> None:
        self._plane = plane

    def move(self, moves: Sequence[ExtentMove]) -> list[bool | None]:
        return self._plane.copy_many(extent_pairs(moves))


@dataclass(frozen=True)
class PlaneStats:
    engine: str
    queue_depth: int
    direct: bool  # False once a filesystem refused O_DIRECT: buffered I/O
    bytes_read: int
    bytes_written: int
    blocks_read: int
    blocks_written: int
    bad_reads: int  # blocks whose bytes failed their checksum


@dataclass(frozen=True)
class _Open:
    fd: int


class _Pinned:
    """What ``BlockReader`` asks of the books, answered from extents pinned elsewhere: the
    lookup is the extent and its open file, the verdict is kept for the caller."""

    def __init__(self, extents: Sequence[Extent], fds: dict[str, int]) -> None:
        self._by_key = {e.key: e for e in extents}
        self._fds = fds
        self.bad: set[bytes] = set()

    def lookup(self, key: bytes, min_room: int | None = None) -> tuple[Extent, _Open] | None:
        ext = self._by_key.get(key)
        return None if ext is None else (ext, _Open(self._fds[ext.path]))

    def release(self, seg: _Open) -> None:
        pass  # the file stays open for the plane; the pin is the caller's to end

    def verified(self, entry: Extent, ok: bool) -> bool:
        if not ok:
            self.bad.add(entry.key)
        return ok


class ExtentPlane:
    def __init__(self, engine: str = "auto", queue_depth: int = 16, io_bytes: int = 4 << 20,
                 staging_bytes: int = 4 << 20, io: ExtentIo | None = None) -> None:
        self.io = io or ExtentIo(make_io_engine(engine, queue_depth, io_bytes), staging_bytes)
        self.direct = True
        # Open segment files, most recently used last. Bounded: a segment that compaction
        # deleted keeps its disk space until its descriptor here is closed.
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._users: dict[int, int] = {}  # descriptor -> calls using it now
        self._deleted: set[int] = set()  # of files deleted since, out of _fds, still in use
        self._lock = threading.Lock()
        self._cbuf: np.ndarray | None = None  # compaction's buffer (one copy_many at a time)
        self._copying = threading.Lock()
        self._counts = dict.fromkeys(("bytes_read", "bytes_written", "blocks_read",
                                      "blocks_written", "bad_reads"), 0)

    # -- reads ---------------------------------------------------------------------------------

    def read_many(self, extents: Sequence[Extent], dsts: Sequence[np.ndarray]) -> list[bool]:
        """Read each extent's block into the front of its buffer, many in flight; per block,
        whether its bytes matched its checksum. Bytes past a block are left alone."""
        if len(extents) != len(dsts):
            raise ValueError(f"{len(extents)} extents but {len(dsts)} buffers")
        if len({e.key for e in extents}) != len(extents):
            raise ValueError("an extent is listed twice")
        with self._open_all(extents) as fds:
            books = _Pinned(extents, fds)
            # _Pinned answers the three calls BlockReader makes of NvmeBooks, from pinned extents.
            reader = BlockReader(books, self.io)  # type: ignore[arg-type]  # see above
            hits = reader.get_many_into([e.key for e in extents], dsts)
        with self._lock:
            c = self._counts
            c["bytes_read"] += sum(e.size for e in extents)
            c["blocks_read"] += len(extents)
            c["bad_reads"] += len(books.bad)
        return hits

    def read_at(self, path: str, ios: Sequence[tuple[int, np.ndarray]]) -> None:
        """Read each (file offset, page-aligned buffer) of ``path``, all in flight at once:
        the chunks of a partial load, checked by the caller against the chunk checksums."""
        with self._open(path) as fd:
            self.io.engine.read([(fd, offset, dst) for offset, dst in ios])
        with self._lock:
            self._counts["bytes_read"] += sum(dst.nbytes for _, dst in ios)

    # -- writes --------------------------------------------------------------------------------

    def write_many(self, extents: Sequence[Extent], srcs: Sequence[np.ndarray]
                   ) -> list[tuple[int, bytes]]:
        """Write each buffer's front (``extent.size`` bytes) to its extent, all in flight at
        once; per block its checksums (block, chunks), computed while the writes run. Raises
        the first failure once every write has settled (none of them may then be committed)."""
        if len(extents) != len(srcs):
            raise ValueError(f"{len(extents)} extents but {len(srcs)} buffers")
        views = [src[: e.size] for e, src in zip(extents, srcs)]
        sums: list[tuple[int, bytes]] = []
        with self._open_all(extents) as fds:
            batches: list[IoBatch] = []
            failure: BaseException | None = None
            try:
                for e, view in zip(extents, views):
                    if e.size % ALIGN == 0 and is_aligned(view):
                        batches.append(self.io.submit_write([(fds[e.path], e.offset, view)]))
                for b in batches[:1]:
                    b.wait_started()  # hash while the writes run
                for e, view in zip(extents, views):
                    if e.size % ALIGN == 0 and is_aligned(view):
                        sums.append(block_sums(view))
                    else:  # its tail through staging, written at once
                        sums.append(self.io.write(fds[e.path], e.offset, view))
            except BaseException as exc:
                failure = exc
            for b in batches:  # settle every write, even after a failure
                try:
                    b.wait()
                except BaseException as exc:
                    failure = failure or exc
            if failure is not None:
                raise failure
        with self._lock:
            self._counts["bytes_written"] += sum(e.size for e in extents)
            self._counts["blocks_written"] += len(extents)
        return sums

    # -- compaction ----------------------------------------------------------------------------

    def copy_many(self, pairs: Sequence[tuple[Extent, Extent]],
                  window: int = COPY_WINDOW) -> list[bool | None]:
        """Copy each block from its first extent to its second (compaction), many in flight,
        through one reused buffer of ``window`` bytes (or one block's extent, if larger); per
        block True, or None if its bytes failed their checksum (it was not copied)."""
        with self._copying:
            return self._copy_many(pairs, window)

    def _copy_many(self, pairs: Sequence[tuple[Extent, Extent]],
                   window: int) -> list[bool | None]:
        out: list[bool | None] = []
        start = 0
        while start < len(pairs):
            stop, room = start, window
            while stop < len(pairs) and (stop == start or pairs[stop][0].extent <= room):
                room -= pairs[stop][0].extent
                stop += 1
            batch = pairs[start:stop]
            need = sum(src.extent for src, _ in batch)
            if self._cbuf is None or self._cbuf.nbytes < need:
                self._cbuf = alloc_aligned(max(need, window))
            views, pos = [], 0
            for src, _ in batch:
                views.append(self._cbuf[pos : pos + src.extent])
                pos += src.extent
            ok = self.read_many([src for src, _ in batch], views)
            good = [i for i, fine in enumerate(ok) if fine]
            self.write_many([batch[i][1] for i in good], [views[i] for i in good])
            out += [True if fine else None for fine in ok]
            start = stop
        return out

    # -- files ---------------------------------------------------------------------------------

    @contextmanager
    def _open_all(self, extents: Sequence[Extent]) -> Iterator[dict[str, int]]:
        with ExitStack() as stack:
            yield {p: stack.enter_context(self._open(p)) for p in {e.path for e in extents}}

    @contextmanager
    def _open(self, path: str) -> Iterator[int]:
        """A descriptor of ``path`` held open for the duration of one call."""
        # Books never reuse a segment's name while they run, but books restarted over the
        # directory (a tier actor restarted while this agent runs on) may make a deleted
        # segment's name again: a descriptor cached here of the deleted file would take the
        # new file's writes, and they would never reach the disk. Such a one is closed (once no
        # call uses it) and the name opened again.
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None and os.fstat(fd).st_nlink == 0:
                del self._fds[path]
                if fd in self._users:
                    self._deleted.add(fd)  # closed by the last call using it
                else:
                    self._close(fd)
                fd = None
            if fd is None:
                fd = self._fds[path] = self._open_file(path)
                self.io.engine.register_file(fd)
            self._fds.move_to_end(path)
            self._users[fd] = self._users.get(fd, 0) + 1
        try:
            yield fd
        finally:
            with self._lock:
                self._users[fd] -= 1
                if not self._users[fd]:
                    del self._users[fd]
                    if fd in self._deleted:
                        self._deleted.discard(fd)
                        self._close(fd)
                self._trim()

    def _open_file(self, path: str) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
                log.warning("%s refuses O_DIRECT (%s): NVMe I/O goes through the page cache",
                            os.path.dirname(path), exc.strerror)
        return os.open(path, os.O_RDWR)

    def _trim(self) -> None:
        """Close the least recently used descriptors no call is using, down to the bound."""
        for path in list(self._fds):
            if len(self._fds) <= MAX_OPEN_SEGMENTS:
                return
            fd = self._fds[path]
            if fd not in self._users:
                del self._fds[path]
                self._close(fd)

    def _close(self, fd: int) -> None:
        self.io.engine.unregister_file(fd)
        os.close(fd)

    def stats(self) -> PlaneStats:
        with self._lock:
            return PlaneStats(self.io.engine.name, self.io.queue_depth, self.direct,
                              **self._counts)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._deleted]:
                self._close(fd)
            self._fds.clear()
            self._deleted.clear()
        self.io.close()
