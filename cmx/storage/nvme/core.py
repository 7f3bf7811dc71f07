"""The state of the NVMe store: opening, closing, flush and snapshot; the books are in books.py.

Locks, always taken in this order: ``_space_lock`` (one writer makes room at a time: eviction,
compaction, reservation), ``_flush_lock`` (one flush or snapshot at a time), ``_lock`` (every
read or change of the books; an RLock so event subscribers may call back). I/O never runs
under ``_lock``: a reader or writer takes an I/O reference on its segment under the lock, so
the file outlives the I/O even if compaction retires it meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cmx.errors import StoreClosedError, StoreLockedError
from cmx.policies import EvictionPolicy, make_eviction
from cmx.storage.nvme.books import BooksMixin
from cmx.storage.nvme.chunks import extent_bytes
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.errors import StoreIOError
from cmx.storage.nvme.files import FileOps, check_directory
from cmx.storage.nvme.io import make_io_engine
from cmx.storage.nvme.journal import Journal
from cmx.storage.nvme.records import RecordDel, encode_del, encode_put
from cmx.storage.nvme.recovery import recover
from cmx.storage.nvme.segments import Segment, SegmentSet
from cmx.storage.nvme.snapshot import write_snapshot
from cmx.storage.nvme.space import SpaceMixin
from cmx.storage.nvme.staging import Staging

__all__ = ["NvmeCore"]

_GIB = 1 << 30


class NvmeCore(BooksMixin, SpaceMixin):
    """State and bookkeeping shared by every NvmeStore operation.

    Arguments:
        root: directory of the store (created if missing); one open store per directory.
        capacity_bytes: bytes of block extents (payload padded to 4 KiB) the store may hold;
            dead space counts too until compaction reclaims it. Segment files on disk never
            exceed ``capacity_bytes + segment_bytes`` (the slack compaction copies into, and
            the active segment's space allocated ahead of its writes).
        block_bytes: the largest block accepted.
        segment_bytes: size of one segment file; default capacity/8 within [one block, 1 GiB].
        eviction: eviction policy name (``cmx.policies.make_eviction``) or instance.
        io_engine: "threads", "nixl" or "auto" (see ``io.AUTO_ORDER``).
        queue_depth: I/Os in flight per engine; io_bytes: the largest single I/O.
        staging_bytes: budget of each of the two staging buffers (writes, reads) used for
            unaligned caller buffers; at most one block's extent is mapped.
        compact_threshold_bytes: dead space above which compaction runs before eviction
            when a put needs room; default one segment.
        snapshot_every: journal records after which a flush writes a snapshot instead.
        files: the file system calls (``files.FileOps``); tests pass one that records them.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        *,
        segment_bytes: int | None = None,
        eviction: str | EvictionPolicy = "lru",
        io_engine: str = "auto",
        queue_depth: int = 16,
        io_bytes: int = 4 << 20,
        staging_bytes: int = 64 << 20,
        compact_threshold_bytes: int | None = None,
        snapshot_every: int = 1 << 16,
        files: FileOps | None = None,
    ) -> None:
        super().__init__()
        if capacity_bytes <= 0 or block_bytes <= 0:
            raise ValueError(f"capacity {capacity_bytes} and block_bytes {block_bytes} must be > 0")
        block_ext = extent_bytes(block_bytes)
        if segment_bytes is None:
            segment_bytes = min(max(block_ext, capacity_bytes // 8 // 4096 * 4096), _GIB)
            segment_bytes = max(segment_bytes, block_ext)
        if segment_bytes < block_ext or segment_bytes % 4096:
            raise ValueError(f"segment_bytes {segment_bytes} must be a multiple of 4096 and hold "
                             f"one block ({block_ext})")
        self.root = os.fspath(root)
        self._capacity = capacity_bytes
        self._block_bytes = block_bytes
        self._compact_threshold = compact_threshold_bytes or segment_bytes
        self._snapshot_every = snapshot_every
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._space_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._index: dict[bytes, BlockEntry] = {}
        self._pins: dict[bytes, int] = {}
        self._reserving: set[bytes] = set()
        self._pending: list[BlockEntry | RecordDel] = []  # records waiting for the next flush
        self._next_seq = 1
        self._snapshot_due = False
        self._ops = 0
        self._closed = True  # until opened
        self._counts = dict.fromkeys(
            ("hits", "misses", "evictions", "quarantined", "bytes_written", "bytes_read",
             "bytes_requested", "bytes_read_from_disk", "compactions", "compacted_bytes"), 0)
        self._files = files or FileOps()
        check_directory(self.root)
        self._lock_fd = _lock_dir(self._files, self.root)
        try:
            self._policy = make_eviction(eviction)
            self._engine = make_io_engine(io_engine, queue_depth, io_bytes, self._files)
            stage = min(staging_bytes, block_ext)
            self._wstage, self._rstage = Staging(stage), Staging(stage)
            self._segs = SegmentSet(self.root, segment_bytes, self._engine,
                                    file_limit=capacity_bytes + segment_bytes, files=self._files)
            self._journal = Journal(os.path.join(self.root, "journal.log"), self._files)
            self._open_index()
        except BaseException:
            self._teardown()
            raise
        self._closed = False

    def _open_index(self) -> None:
        snap_path = os.path.join(self.root, "index.arrow")
        got = recover(self.root, snap_path, self._journal, self._segs, self._files)
        self._index = got.index
        self._next_seq = got.next_seq
        for entry in self._index.values():
            self._policy.insert(entry.key, entry.parent)
        if got.clean:
            self._journal.open_append(got.journal_gen, got.valid_bytes)
        else:  # replayed records or a torn tail: fold everything into a fresh snapshot
            with self._flush_lock:
                self._snapshot(got.journal_gen)

    # -- properties ----------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    # -- operations and closing ----------------------------------------------------------------

    @contextmanager
    def _op(self) -> Iterator[None]:
        """Mark an operation in progress; close() waits for it. Raises if closed."""
        with self._lock:
            if self._closed:
                raise StoreClosedError(f"NVMe store at {self.root} is closed")
            self._ops += 1
        try:
            yield
        finally:
            with self._lock:
                self._ops -= 1
                if not self._ops:
                    self._idle.notify_all()

    def close(self) -> None:
        """Flush, snapshot the index and release files, engine and directory lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._ops:
                self._idle.wait()
        try:
            with self._flush_lock:
                self._snapshot()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        for part in ("_journal", "_segs", "_engine"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()
        if self._lock_fd >= 0:
            self._files.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # -- flush and snapshot --------------------------------------------------------------------

    def flush(self) -> None:
        with self._op():
            self._flush()

    def _flush(self) -> None:
        with self._flush_lock:
            if self._snapshot_due or self._journal.records >= self._snapshot_every:
                self._snapshot()
                return
            records, dirty, retired = self._take_pending()
            try:
                records, failure = self._persist(records, dirty)
                if records:
                    gen = self._journal.generation
                    self._journal.append(_encode(r, gen) for r in records)
                    self._journal.sync()
            except BaseException as exc:
                # The journal may now hold torn or unsynced records: the next flush writes a
                # snapshot, which does not depend on them.
                self._snapshot_due = self._snapshot_due or isinstance(exc, OSError)
                self._restore(records, dirty)
                raise
            self._settle(dirty, retired)
            if failure is not None:
                raise failure

    def _snapshot(self, gen: int | None = None) -> None:
        """Write every entry to a new snapshot and restart the journal. Holds _flush_lock."""
        records, dirty, retired = self._take_pending()
        new_gen = (self._journal.generation if gen is None else gen) + 1
        try:
            records, failure = self._persist(records, dirty)
            with self._lock:
                entries = list(self._index.values())
                next_segment, next_seq = self._segs.next_id, self._next_seq
                tombstones = self._segs.tombstones()
            write_snapshot(self._files, os.path.join(self.root, "index.arrow"), entries,
                           new_gen, next_segment, next_seq)
        except BaseException:
            self._restore(records, dirty)
            raise
        self._snapshot_due = True  # until the journal has the new generation
        try:
            carried = b"".join(encode_del(RecordDel(key, seq, seg), new_gen)
                               for seg, seq, key in tombstones)
            self._journal.restart(new_gen, carried)
            self._snapshot_due = False
        finally:
            self._settle(dirty, retired)
        if failure is not None:
            raise failure

    def _take_pending(self) -> tuple[list[BlockEntry | RecordDel], list[Segment], list[Segment]]:
        with self._lock:
            records, self._pending = self._pending, []
            dirty = [self._segs.ref(i) for i in self._segs.dirty if i in self._segs.segs]
            self._segs.dirty = set()
            return records, dirty, self._segs.retired_pending()

    def _persist(self, records: list[BlockEntry | RecordDel], dirty: list[Segment]
                 ) -> tuple[list[BlockEntry | RecordDel], StoreIOError | None]:
        """Make the blocks of ``records`` durable in their segments: data fdatasync'ed, then
        a PUT in each segment's record log, synced. A segment whose sync fails is broken and
        its unrecorded blocks dropped (they were never acknowledged). Returns the records
        left for the journal and the first failure, raised by the caller after journaling."""
        failure: StoreIOError | None = None
        for seg in dirty:
            try:
                self._files.fdatasync(seg.fd)
            except StoreIOError as exc:
                failure = failure or exc
                with self._lock:
                    self._segs.break_(seg)
        by_seg: dict[int, list[BlockEntry]] = {}
        for r in records:
            if isinstance(r, BlockEntry):
                by_seg.setdefault(r.seg, []).append(r)
        lost: set[int] = set()
        for seg_id, puts in by_seg.items():
            target = self._segs.segs.get(seg_id)
            if target is None or target.broken:
                lost.update(r.seq for r in puts)
                continue
            try:
                target.records.append(encode_put(r, seg_id) for r in puts)
                target.records.sync()
            except StoreIOError as exc:
                failure = failure or exc
                lost.update(r.seq for r in puts)
                with self._lock:
                    self._segs.break_(target)
        if lost:
            self._drop_unrecorded([r for r in records if isinstance(r, BlockEntry)
                                   and r.seq in lost])
        return [r for r in records if not (isinstance(r, BlockEntry) and r.seq in lost)], failure

    def _drop_unrecorded(self, entries: list[BlockEntry]) -> None:
        with self._lock:
            for entry in entries:
                if self._index.get(entry.key) is entry:
                    self._remove(entry)
                    self._counts["quarantined"] += 1

    def _restore(self, records: list, dirty: list[Segment]) -> None:
        with self._lock:
            self._pending[:0] = records
            self._segs.dirty.update(s.id for s in dirty if not s.broken)
            for seg in dirty:
                self._segs.unref(seg)

    def _settle(self, dirty: list[Segment], retired: list[Segment]) -> None:
        with self._lock:
            for seg in dirty:
                self._segs.unref(seg)
            self._segs.mark_durable(retired)


def _encode(record: BlockEntry | RecordDel, gen: int) -> bytes:
    return encode_del(record, gen) if isinstance(record, RecordDel) else encode_put(record, gen)


def _lock_dir(files: FileOps, root: str) -> int:
    fd = files.open(os.path.join(root, "LOCK"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        files.close(fd)
        raise StoreLockedError(f"{root} is already open in another NvmeStore") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
