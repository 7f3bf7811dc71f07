"""NvmeBooks: the control plane of the NVMe store (index, segments, space, durability).

It decides and records; it never moves a block's bytes (``ExtentIo`` does). Protocol of a
write, in call order: ``reserve(key, size, parent, tag)`` -> a Reservation (segment and
offset, space held, an I/O reference on the segment) or None if the key is stored or being
stored; the caller writes the extent; then ``commit(reservation, checksum, chunk_sums)``
(visible at once, durable at the next ``flush``) or ``abort(reservation)``. A read:
``lookup(key)`` -> (entry, segment with an I/O reference), the caller reads, then
``release(segment)`` and ``verified(entry, ok)`` (counts the hit, or quarantines the block).

Parts, each owning its state: ``BlockIndex`` (entries, pins, policy, sequence numbers),
``SegmentSet`` (files and their live/pending/dead bytes), ``Space`` (eviction, compaction),
``Durability`` (journal, record logs, snapshot). The books own the lock they are all read and
changed under, the counters, and the bookkeeping of operations in progress (``close`` waits
for them). Locks, always taken in this order: the space lock, the flush lock, the books'
lock (an RLock so event subscribers may call back). I/O never runs under the books' lock.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from cmx.errors import BlockStateError, StoreClosedError, StoreLockedError
from cmx.keys import BlockHash
from cmx.policies import EvictionPolicy, make_eviction
from cmx.storage.base import EventKind, NvmeStats
from cmx.storage.nvme.checks import check_segments
from cmx.storage.nvme.chunks import extent_bytes
from cmx.storage.nvme.durability import Durability
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.files import FileOps, check_directory
from cmx.storage.nvme.index import BlockIndex
from cmx.storage.nvme.records import RecordDel
from cmx.storage.nvme.recovery import recover
from cmx.storage.nvme.segments import Segment, SegmentSet
from cmx.storage.nvme.space import LocalMover, Mover, Space

__all__ = ["NvmeBooks", "Reservation"]

Emit = Callable[[EventKind, BlockHash, int, int | None], None]


@dataclass(frozen=True, eq=False)
class Reservation:
    """Space held for one block's extent until commit or abort."""

    key: bytes
    parent: bytes | None
    tag: str
    seg: Segment
    offset: int  # of the extent in the segment file, 4 KiB-aligned
    size: int  # payload bytes; the extent is extent_bytes(size)

    @property
    def extent(self) -> int:
        return extent_bytes(self.size)


class NvmeBooks:
    """See the module docstring. ``NvmeStore`` documents the arguments."""

    def __init__(self, root: str, capacity: int, segment_bytes: int, compact_threshold: int,
                 snapshot_every: int, eviction: str | EvictionPolicy, io: ExtentIo,
                 files: FileOps, emit: Emit, mover: Mover | None = None) -> None:
        self.root = root
        self.capacity = capacity
        self.files = files
        self.lock = threading.RLock()
        self._idle = threading.Condition(self.lock)
        self._ops = 0
        self.closed = True  # until opened
        self._emit = emit
        self.counts = dict.fromkeys(("hits", "misses", "quarantined", "bytes_written",
                                     "bytes_read", "bytes_requested", "bytes_read_from_disk"), 0)
        check_directory(root)
        self._engine = io.engine  # for its figures in stats()
        self.index = BlockIndex(make_eviction(eviction))
        self._lock_fd = _lock_dir(files, root)
        self.segs = SegmentSet(root, segment_bytes, io.engine,
                               file_limit=capacity + segment_bytes, files=files)
        self.durability = Durability(root, files, self.lock, self.index, self.segs,
                                     snapshot_every, self._drop_unrecorded)
        self.space = Space(self.lock, self.index, self.segs, mover or LocalMover(io), capacity,
                           compact_threshold,
                           self.remove, self.quarantine, self.durability.note_move, self.flush)

    def open(self) -> None:
        """Recover the index from the directory (see recovery.py); then the books are open."""
        d = self.durability
        got = recover(self.root, d.snapshot_path, d.journal, self.segs, self.files)
        self.index.load(got.index, got.next_seq)
        if got.clean:
            d.journal.open_append(got.journal_gen, got.valid_bytes)
        else:  # replayed records, a torn tail or a rebuild: fold it all into a new snapshot
            d.snapshot(got.journal_gen)
        self.closed = False

    # -- operations and closing ----------------------------------------------------------------

    @contextmanager
    def op(self) -> Iterator[None]:
        """Mark an operation in progress; close() waits for it. Raises if closed."""
        with self.lock:
            if self.closed:
                raise StoreClosedError(f"NVMe store at {self.root} is closed")
            self._ops += 1
        try:
            yield
        finally:
            with self.lock:
                self._ops -= 1
                if not self._ops:
                    self._idle.notify_all()

    def close(self) -> None:
        """Wait for operations in progress, snapshot, release files. False if already closed."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            while self._ops:
                self._idle.wait()
        try:
            self.durability.snapshot()
        finally:
            self.teardown()

    def teardown(self) -> None:
        """Release files and the directory lock without a snapshot (as a crash would)."""
        self.closed = True
        self.durability.close()
        self.segs.close()
        if self._lock_fd >= 0:
            self.files.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def flush(self) -> None:
        self.durability.flush()

    # -- writes --------------------------------------------------------------------------------

    def reserve(self, key: bytes, size: int, parent: bytes | None = None,
                tag: str = "") -> Reservation | None:
        got = self.space.reserve(key, extent_bytes(size))
        if got is None:
            return None
        seg, offset = got
        return Reservation(key, parent, tag, seg, offset, size)

    def commit(self, r: Reservation, checksum: int, chunk_sums: bytes) -> BlockEntry:
        """Make a written block visible (durable at the next flush)."""
        entry = BlockEntry(r.key, r.parent, r.seg.id, r.offset, r.size, checksum, chunk_sums,
                           tag=r.tag)
        with self.lock:
            self.index.reserving.discard(r.key)
            self.segs.finish_write(r.seg, r.extent, r.key)
            entry = self.index.commit(entry)
            self.durability.note(entry)
            self.counts["bytes_written"] += entry.length
            self._emit(EventKind.STORED, BlockHash(entry.key), entry.length, entry.checksum)
        return entry

    def abort(self, r: Reservation) -> None:
        """Give up a reservation; its bytes become dead space."""
        with self.lock:
            self.index.reserving.discard(r.key)
            self.segs.finish_write(r.seg, r.extent, None)

    def adopt_tag(self, key: bytes, tag: str, checksum: int) -> bool:
        """Give a committed block stored without a tag ``tag``, its bytes untouched: a new
        record of the same extent (durable at the next flush; the old record ends). False, and
        nothing changes, where the block is absent, tagged already, holds other bytes than
        ``checksum`` says, lies in a segment whose records can no longer be appended, or was
        moved by a compaction not yet durable (a failed sync would put it back untagged)."""
        with self.lock:
            entry = self.index.get(key)
            if (not tag or entry is None or entry.tag or entry.checksum != checksum
                    or self.segs.segs[entry.seg].broken or self.durability.moving(entry)):
                return False
            tagged = self.index.retag(entry, tag)
            self.segs.supersede(entry.seg, key, entry.seq)
            self.durability.note_retag(tagged, RecordDel(key, entry.seq, entry.seg))
            # Announced again: a directory that knows the block untagged learns its tag.
            self._emit(EventKind.STORED, BlockHash(key), tagged.length, tagged.checksum)
            return True

    # -- reads ---------------------------------------------------------------------------------

    def lookup(self, key: bytes, min_room: int | None = None
               ) -> tuple[BlockEntry, Segment] | None:
        """The entry of ``key`` and its segment with an I/O ref held; None (a miss) if absent."""
        with self.lock:
            entry = self.index.get(key)
            if entry is None:
                self.counts["misses"] += 1
                return None
            if min_room is not None and min_room < entry.length:
                raise ValueError(f"buffer of {min_room} bytes < block of {entry.length}")
            return entry, self.segs.ref(entry.seg)

    def lookup_runs(self, reqs: Sequence[tuple[bytes, int, int]]
                    ) -> tuple[list[BlockEntry | None], dict[int, Segment]]:
        """Entries (None for misses) and their segments, one I/O ref each, for slice reads."""
        with self.lock:
            entries = [self.index.get(key) for key, _, _ in reqs]
            for (key, off, length), entry in zip(reqs, entries):
                if entry is not None and (off < 0 or length < 0 or off + length > entry.length):
                    raise ValueError(f"range [{off}, {off + length}) is outside block "
                                     f"{key.hex()[:12]} of {entry.length} bytes")
            self.counts["misses"] += len({k for (k, _, _), e in zip(reqs, entries) if e is None})
            segs = {e.seg: self.segs.ref(e.seg) for e in entries if e is not None}
            return entries, segs

    def release(self, seg: Segment) -> None:
        with self.lock:
            self.segs.unref(seg)

    def verified(self, entry: BlockEntry, ok: bool) -> bool:
        """Count a whole-block read: a hit, or (``ok`` False) a miss and a quarantine."""
        if not ok:
            self.quarantine(entry)
            with self.lock:
                self.counts["misses"] += 1
            return False
        with self.lock:
            c = self.counts
            c["hits"] += 1
            c["bytes_read"] += entry.length
            c["bytes_requested"] += entry.length
            c["bytes_read_from_disk"] += entry.extent
            self.index.policy.touch(entry.key)
        return True

    def count_runs(self, entries: list[BlockEntry | None], bad: set[bytes], requested: int,
                   read: int) -> None:
        with self.lock:
            c = self.counts
            c["bytes_requested"] += requested
            c["bytes_read_from_disk"] += read
            for entry in {e.key: e for e in entries if e is not None}.values():
                if entry.key in bad:
                    c["misses"] += 1
                else:
                    c["hits"] += 1
                    self.index.policy.touch(entry.key)
            c["bytes_read"] += requested

    # -- removals ------------------------------------------------------------------------------

    def remove(self, entry: BlockEntry) -> None:
        """Drop a committed block (caller holds the lock); its bytes become dead."""
        self.index.remove(entry)
        self.segs.drop(entry.seg, entry.key, entry.extent, entry.seq)
        self.durability.note(RecordDel(entry.key, entry.seq, entry.seg))
        self._emit(EventKind.REMOVED, BlockHash(entry.key), entry.length, entry.checksum)

    def quarantine(self, entry: BlockEntry) -> None:
        with self.lock:
            if self.index.get(entry.key) is entry:
                self.remove(entry)
                self.counts["quarantined"] += 1

    def _drop_unrecorded(self, entries: list[BlockEntry]) -> None:
        for entry in entries:
            self.quarantine(entry)

    def delete(self, key: bytes) -> bool:
        with self.lock:
            entry = self.index.get(key)
            if entry is None:
                return False
            if self.index.pinned(key):
                raise BlockStateError(f"block {key.hex()[:12]} is pinned "
                                      f"{self.index.pinned(key)}x")
            self.remove(entry)
            return True

    def delete_tagged(self, tag: str) -> int:
        with self.lock:
            gone = [e for e in self.index.entries.values()
                    if e.tag == tag and not self.index.pinned(e.key)]
            for entry in gone:
                self.remove(entry)
            return len(gone)

    # -- stats and self-checks -----------------------------------------------------------------

    def stats(self) -> NvmeStats:
        with self.lock:
            c, space, segs, engine = self.counts, self.space, self.segs, self._engine
            requested = c["bytes_requested"]
            return NvmeStats(
                capacity_bytes=self.capacity,
                used_bytes=segs.used_bytes,
                blocks=len(self.index),
                pinned=self.index.pinned_blocks,
                hits=c["hits"],
                misses=c["misses"],
                evictions=space.evictions,
                quarantined=c["quarantined"],
                bytes_written=c["bytes_written"],
                bytes_read=c["bytes_read"],
                io_engine=engine.name,
                direct_io=segs.direct,
                queue_depth=engine.queue_depth,
                io_bytes=engine.io_bytes,
                segments=len(segs.segs),
                segment_bytes=segs.segment_bytes,
                disk_bytes=segs.disk_bytes,
                file_bytes=segs.file_bytes,
                dead_bytes=segs.dead_bytes,
                compactions=space.compactions,
                compacted_bytes=space.compacted_bytes,
                journal_records=self.durability.journal.records,
                broken_segments=sum(1 for s in segs.segs.values() if s.broken),
                io_size_histogram=engine.io_sizes("read"),
                write_io_size_histogram=engine.io_sizes("write"),
                bytes_requested=requested,
                bytes_read_from_disk=c["bytes_read_from_disk"],
                read_amplification=c["bytes_read_from_disk"] / requested if requested else 0.0,
            )

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if index, segments, files or policy disagree."""
        with self.lock:
            check_segments(self.index, self.segs)
            used, disk = self.segs.used_bytes, self.segs.file_bytes
            if used > self.capacity:
                raise AssertionError(f"used {used} > capacity {self.capacity}")
            limit = self.capacity + self.segs.segment_bytes
            if disk > limit:
                raise AssertionError(f"disk {disk} > capacity {self.capacity} + segment "
                                     f"{self.segs.segment_bytes}")
            self.index.check()


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
