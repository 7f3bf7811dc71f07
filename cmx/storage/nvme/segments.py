"""Segment files: the log the blocks are appended to, and the books of each file's bytes.

A segment ``seg-<id>.dat`` grows by appending extents at its head until the next extent would
pass ``segment_bytes``; then it is sealed and a new segment (the next id, never reused) becomes
the active one. The active segment's file is allocated up front (``fallocate``, up to
``segment_bytes``), so that appends are overwrites of allocated space: ext4 and XFS serialize
O_DIRECT writes that extend a file or fill a hole (an exclusive inode lock per write), which
would leave one write in flight however many the engine issues. Allocation ahead stays within
``file_limit``: the files never hold more bytes than that, allocated or written.

Each byte below a head is live (a committed block), pending (a write in flight) or dead (a
block that left, or a write that failed): ``head == live + pending + dead``.

A sealed segment with nothing live or pending is *retired*. Its file is deleted once the
journal records that emptied it are durable (``mark_durable``) and no I/O holds it
(``io_refs``), so a crash can never replay a record into a deleted file whose id was reused.

Ids are never reused across crashes either: a write granted by an incarnation that died may
still land at its path and offset, so a recreated file of that id would take it over another
block. Before a segment is created, ``next-segment`` records (atomically, synced) an id past
it, a few ids ahead at a time (``RESERVE_IDS``); reopening starts past it (``reserved_ids``)
even where the snapshot is older than a file since deleted, and records it again.

Beside each segment file lies its record log ``seg-<id>.rec`` (``journal.RecordLog``): a PUT
record for every block committed there, appended at each flush after the segment's data is
fdatasync'ed, and synced before the next snapshot (until then the journal holds the same
records). With the journal's DEL records it lets the index be rebuilt from the segments
alone when the snapshot is lost. Records of blocks that left a live segment are remembered
(``killed``) so that a snapshot can carry their DELs into the next journal.

A segment whose fdatasync failed is *broken*: the page cache may have dropped its unsynced
bytes, so it is sealed, and a block of it not yet recorded is dropped rather than
acknowledged (see ``durability.py``).

Not thread-safe: the store calls every method under its lock.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass, field

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.io import IoEngine
from cmx.storage.nvme.journal import SEGMENT_MAGIC, RecordLog

__all__ = ["RESERVE_IDS", "Segment", "SegmentSet", "segment_ids"]

log = logging.getLogger(__name__)

HIGH_WATER = "next-segment"  # the id no segment created so far reaches: ascii digits
RESERVE_IDS = 16  # ids recorded ahead at a time: one synced write per 16 segments

_NAME = re.compile(r"^seg-(\d{6,})\.dat$")


def segment_ids(root: str) -> list[int]:
    """Ids of the segment files under ``root``, ascending."""
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _NAME.match(name)))


@dataclass(eq=False)
class Segment:
    id: int
    path: str
    fd: int
    records: RecordLog  # the segment's own record log
    head: int = 0  # bytes appended so far
    allocated: int = 0  # bytes of the file allocated ahead of the head, from its start
    live: int = 0  # extent bytes of committed blocks
    pending: int = 0  # extent bytes reserved by writes in flight
    keys: set[bytes] = field(default_factory=set)  # committed blocks stored here
    killed: dict[int, bytes] = field(default_factory=dict)  # seq -> key of ended records
    io_refs: int = 0  # I/Os running outside the store lock
    sealed: bool = False  # no more appends
    retired: bool = False  # empty; delete when durable and unreferenced
    durable: bool = False  # the records that emptied it are in the journal
    broken: bool = False  # a data sync failed: unrecorded blocks here are dropped
    records_unsynced: bool = False  # record-log appends not yet synced
    records_stale: bool = False  # a record-log append failed: rewrite it before a snapshot

    @property
    def dead(self) -> int:
        return self.head - self.live - self.pending


class SegmentSet:
    def __init__(self, root: str, segment_bytes: int, engine: IoEngine,
                 file_limit: int | None = None, files: FileOps | None = None) -> None:
        self.root = root
        self.segment_bytes = segment_bytes
        self.file_limit = file_limit  # most bytes all segment files may take; None: no bound
        self.engine = engine
        self.files = files or FileOps()
        self.segs: dict[int, Segment] = {}
        self.active: Segment | None = None
        self.next_id = 1
        self.reserved = 0  # ids below it are recorded in ``HIGH_WATER`` (``reserve``)
        self.direct = True  # False where the filesystem refuses O_DIRECT (tmpfs)
        self.dirty: set[int] = set()  # segments written since the last fdatasync

    def path(self, seg_id: int) -> str:
        return os.path.join(self.root, f"seg-{seg_id:06d}.dat")

    def records_path(self, seg_id: int) -> str:
        return os.path.join(self.root, f"seg-{seg_id:06d}.rec")

    # -- files ---------------------------------------------------------------------------------

    def open(self, seg_id: int, create: bool = False) -> Segment:
        """Open (or create) a segment file; its record log is created with it, or left for
        the caller (recovery) to open."""
        if create:
            self.reserve(seg_id)
        path = self.path(seg_id)
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = -1
        if self.direct:
            try:
                fd = self.files.open(path, flags | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if fd < 0:
            fd = self.files.open(path, flags)
        records = RecordLog(self.records_path(seg_id), self.files, SEGMENT_MAGIC)
        try:
            if create:
                records.create(seg_id)  # synced with its first records, before a snapshot
                self.files.fsync_dir(self.root)  # names survive before any record names them
            self.engine.register_file(fd)
        except BaseException:
            records.close()
            self.files.close(fd)
            raise
        seg = Segment(seg_id, path, fd, records, head=os.fstat(fd).st_size)
        self.segs[seg_id] = seg
        self.next_id = max(self.next_id, seg_id + 1)
        return seg

    def reserved_ids(self) -> int:
        """The id past every segment created here before (0: none recorded, or a record
        that does not parse, which is logged)."""
        data = self.files.read_file(os.path.join(self.root, HIGH_WATER))
        if data is None:
            return 0
        try:
            return int(data.decode("ascii"))
        except ValueError:
            log.error("%s: %s does not parse (%r); segment ids restart past the files and "
                      "the snapshot", self.root, HIGH_WATER, data[:32])
            return 0

    def reserve(self, seg_id: int, again: bool = False) -> None:
        """Record, durably, an id past ``seg_id`` before its file is created (unless one is;
        ``again``: in any case): replaced atomically, the directory synced by the creation
        that follows."""
        if seg_id < self.reserved and not again:
            return
        upto = seg_id + RESERVE_IDS
        path = os.path.join(self.root, HIGH_WATER)
        fd = self.files.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self.files.pwrite_all(fd, str(upto).encode("ascii"), 0)
            self.files.fsync(fd)
        finally:
            self.files.close(fd)
        self.files.replace(path + ".tmp", path)
        self.reserved = upto

    def activate(self, seg: Segment) -> None:
        """Make ``seg`` the segment appends go to, its file allocated ahead (see above).

        Allocation is for O_DIRECT files only: on tmpfs (no O_DIRECT) it would take the memory
        of a whole segment up front and buys nothing."""
        seg.sealed = False
        self.active = seg
        want = self.segment_bytes
        if self.file_limit is not None:
            others = self.file_bytes - max(seg.head, seg.allocated)
            want = min(want, (self.file_limit - others) // 4096 * 4096)
        if not self.direct or want <= seg.head:
            return
        if self.files.fallocate(seg.fd, want):
            seg.allocated = want

    def delete(self, seg: Segment) -> None:
        self.engine.unregister_file(seg.fd)
        self.files.close(seg.fd)
        seg.records.close()
        del self.segs[seg.id]
        self.dirty.discard(seg.id)
        if seg is self.active:
            self.active = None
        self.files.unlink(seg.path)
        try:
            self.files.unlink(seg.records.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for seg in list(self.segs.values()):
            self.engine.unregister_file(seg.fd)
            self.files.close(seg.fd)
            seg.records.close()
        self.segs.clear()
        self.active = None

    # -- the books -----------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[Segment, int]:
        """Reserve ``nbytes`` at the log head: (segment, offset). Holds an I/O ref."""
        seg = self.active
        if seg is None or seg.head + nbytes > self.segment_bytes:
            if seg is not None:
                self.seal(seg)
            seg = self.open(self.next_id, create=True)
            self.activate(seg)
        offset = seg.head
        seg.head += nbytes
        seg.pending += nbytes
        seg.io_refs += 1
        return seg, offset

    def finish_write(self, seg: Segment, nbytes: int, key: bytes | None) -> None:
        """End a reserved write: committed as ``key``, or dead space if ``key`` is None."""
        seg.pending -= nbytes
        if key is not None:
            seg.live += nbytes
            seg.keys.add(key)
            self.dirty.add(seg.id)
        self.unref(seg)
        self._maybe_retire(seg)

    def drop(self, seg_id: int, key: bytes, nbytes: int, seq: int) -> None:
        """A committed block's record ``seq`` in segment ``seg_id`` ended: its bytes are dead."""
        seg = self.segs[seg_id]
        seg.live -= nbytes
        seg.keys.discard(key)
        seg.killed[seq] = key
        self._maybe_retire(seg)

    def supersede(self, seg_id: int, key: bytes, seq: int) -> None:
        """Record ``seq`` of a block that stays in segment ``seg_id`` ended: a newer record of
        the same extent replaces it (its bytes stay live)."""
        self.segs[seg_id].killed[seq] = key

    def unmove(self, moved: BlockEntry, source: BlockEntry) -> None:
        """A block's copy to ``moved`` did not become durable: its bytes there are dead, and
        it is live at ``source`` again, whose segment (retired, maybe) stays."""
        dst, src = self.segs[moved.seg], self.segs[source.seg]
        dst.live -= moved.extent
        dst.keys.discard(moved.key)
        self._maybe_retire(dst)
        src.live += source.extent
        src.keys.add(source.key)
        del src.killed[source.seq]
        src.retired = src.durable = False

    def seal(self, seg: Segment) -> None:
        seg.sealed = True
        if seg is self.active:
            self.active = None
        self._trim(seg)
        self._maybe_retire(seg)

    def break_(self, seg: Segment) -> None:
        """A sync of ``seg`` failed: no more appends to it (see the module docstring)."""
        if not seg.broken:
            log.error("segment %s: fdatasync failed; sealed, its unrecorded blocks are dropped",
                      seg.path)
        seg.broken = True
        if not seg.sealed:
            self.seal(seg)

    def tombstones(self) -> list[tuple[int, int, bytes]]:
        """(segment, seq, key) of every ended record in a live segment."""
        return [(s.id, seq, key) for s in self.segs.values() for seq, key in s.killed.items()]

    def ref(self, seg_id: int) -> Segment:
        seg = self.segs[seg_id]
        seg.io_refs += 1
        return seg

    def unref(self, seg: Segment) -> None:
        seg.io_refs -= 1
        self._trim(seg)
        if seg.retired and seg.durable and seg.io_refs == 0:
            self.delete(seg)

    def retired_pending(self) -> list[Segment]:
        """Retired segments still waiting for their journal records to become durable."""
        return [s for s in self.segs.values() if s.retired and not s.durable]

    def mark_durable(self, segs: list[Segment]) -> None:
        for seg in segs:
            if not seg.retired:  # live again: a move out of it was undone
                continue
            seg.durable = True
            if seg.io_refs == 0 and seg.id in self.segs:
                self.delete(seg)

    def _trim(self, seg: Segment) -> None:
        """Give back a sealed segment's space allocated past its head, once no I/O uses it
        (a truncate would wait for every O_DIRECT I/O on the file)."""
        if seg.sealed and seg.allocated > seg.head and seg.io_refs == 0:
            try:
                self.files.ftruncate(seg.fd, seg.head)
            except OSError as exc:  # only space allocated ahead stays taken; retried never
                log.warning("segment %s: giving back allocated space failed: %s", seg.path, exc)
            seg.allocated = seg.head

    def _maybe_retire(self, seg: Segment) -> None:
        if seg.sealed and not seg.retired and seg.live == 0 and seg.pending == 0:
            seg.retired = True

    # -- totals --------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(s.live + s.pending for s in self.segs.values())

    @property
    def disk_bytes(self) -> int:
        return sum(s.head for s in self.segs.values())

    @property
    def file_bytes(self) -> int:
        """Bytes the segment files take: written, or allocated ahead."""
        return sum(max(s.head, s.allocated) for s in self.segs.values())

    @property
    def dead_bytes(self) -> int:
        return sum(s.dead for s in self.segs.values())
