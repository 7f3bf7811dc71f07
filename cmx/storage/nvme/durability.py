"""Durability: what makes a change of the books survive a crash (journal, snapshot, record logs).

It owns the records waiting for the next flush, the journal, the snapshot file and the flush
lock. A flush, in this order (every step after the previous one is on disk):

1. fdatasync the segments written since the last flush;
2. append a PUT for each new block to its segment's record log (not synced: the journal
   holds the same records until the next snapshot);
3. append the PUT and DEL records to the journal and fsync it; or, every
   ``snapshot_every`` records or after a journal failure, write a snapshot: first every record
   log with unsynced appends is synced (one whose append or sync failed is rewritten whole
   from the books), then the snapshot, then the journal restarts carrying the DELs of ended
   records still on disk. So the record logs hold every block from before the last snapshot,
   the journal every block since: a lost snapshot is rebuilt from both.

A segment whose fdatasync fails in 1 is broken (``SegmentSet.break_``): its blocks not yet
recorded are dropped, never acknowledged, through ``drop``. A record that only tags anew an
extent recorded before (``note_retag``) is not one of them: its bytes were synced with the
record it ends, so the block stays, and its record log is rewritten at the next snapshot.
Nor is a block compaction copied there (``note_move``): it goes back to the extent it was
copied from, whose record stays and whose segment is kept until a move of it is durable.
A failed journal append or sync puts the records back and makes the next flush a snapshot,
which does not depend on them.
Either way the flush raises ``StoreIOError``; everything an earlier flush acknowledged stays.

Locks: the flush lock (one flush or snapshot at a time) is taken before the books' lock,
which guards the pending records and the segment books; no I/O runs under the books' lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.errors import StoreIOError
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.index import BlockIndex
from cmx.storage.nvme.journal import Journal
from cmx.storage.nvme.records import RecordDel, encode_del, encode_put
from cmx.storage.nvme.segments import Segment, SegmentSet
from cmx.storage.nvme.snapshot import write_snapshot

__all__ = ["Durability", "Record"]

Record = BlockEntry | RecordDel


class Durability:
    def __init__(self, root: str, files: FileOps, lock: threading.RLock, index: BlockIndex,
                 segs: SegmentSet, snapshot_every: int,
                 drop: Callable[[list[BlockEntry]], None]) -> None:
        self.root = root
        self.files = files
        self.journal = Journal(os.path.join(root, "journal.log"), files)
        self.snapshot_path = os.path.join(root, "index.arrow")
        self.flush_lock = threading.Lock()  # one flush or snapshot at a time
        self._lock = lock  # the books' lock
        self._index = index
        self._segs = segs
        self._snapshot_every = snapshot_every
        self._drop = drop  # the books' removal of blocks a failed sync left unrecorded
        self.pending: list[Record] = []  # records waiting for the next flush
        # Seq of each pending record that re-records an extent already on disk (a tag
        # adopted), to the seq of the record it ends: its bytes are no newer than that one's.
        self._retags: dict[int, int] = {}
        # Seq of each pending record of a block compaction copied, to the entry it was
        # copied from: where the block goes back if the copy's sync fails.
        self._moves: dict[int, BlockEntry] = {}
        self.snapshot_due = False

    def note(self, record: Record) -> None:
        """A change of the books, durable at the next flush (caller holds the books' lock)."""
        self.pending.append(record)

    def note_retag(self, record: BlockEntry, ended: RecordDel) -> None:
        """A new record of a block's extent that ends the record ``ended`` (caller holds the
        books' lock): a failed sync of its segment drops it only where it drops ``ended``."""
        self.pending += [record, ended]
        self._retags[record.seq] = ended.seq

    def note_move(self, moved: BlockEntry, source: BlockEntry) -> None:
        """A block compaction copied from ``source``'s extent to ``moved``'s (caller holds the
        books' lock): a failed sync of the copy's segment puts it back at ``source``."""
        self.pending += [moved, RecordDel(source.key, source.seq, source.seg)]
        self._moves[moved.seq] = source

    def moving(self, entry: BlockEntry) -> bool:
        """Whether ``entry`` is a compaction's copy not yet durable (caller holds the books'
        lock)."""
        return entry.seq in self._moves

    def flush(self) -> None:
        with self.flush_lock:
            if self.snapshot_due or self.journal.records >= self._snapshot_every:
                self._snapshot()
                return
            records, dirty, retired = self._take_pending()
            try:
                records, failure = self._persist(records, dirty)
                if records:
                    gen = self.journal.generation
                    self.journal.append(_encode(r, gen) for r in records)
                    self.journal.sync()
                self._forget_retags(records)
            except BaseException as exc:
                # The journal may now hold torn or unsynced records: the next flush writes a
                # snapshot, which does not depend on them.
                self.snapshot_due = self.snapshot_due or isinstance(exc, OSError)
                self._restore(records, dirty)
                raise
            self._settle(dirty, retired)
            if failure is not None:
                raise failure

    def snapshot(self, gen: int | None = None) -> None:
        with self.flush_lock:
            self._snapshot(gen)

    def _snapshot(self, gen: int | None = None) -> None:
        """Write every entry to a new snapshot and restart the journal."""
        records, dirty, retired = self._take_pending()
        new_gen = (self.journal.generation if gen is None else gen) + 1
        try:
            records, failure = self._persist(records, dirty)
            failure = self._sync_records() or failure
            with self._lock:
                entries = list(self._index.entries.values())
                next_segment, next_seq = self._segs.next_id, self._index.next_seq
                tombstones = self._segs.tombstones()
            write_snapshot(self.files, self.snapshot_path, entries, new_gen, next_segment,
                           next_seq)
            self._forget_retags(records)
        except BaseException:
            self._restore(records, dirty)
            raise
        self.snapshot_due = True  # until the journal has the new generation
        try:
            carried = b"".join(encode_del(RecordDel(key, seq, seg), new_gen)
                               for seg, seq, key in tombstones)
            self.journal.restart(new_gen, carried)
            self.snapshot_due = False
        finally:
            self._settle(dirty, retired)
        if failure is not None:
            raise failure

    def _take_pending(self) -> tuple[list[Record], list[Segment], list[Segment]]:
        with self._lock:
            records, self.pending = self.pending, []
            dirty = [self._segs.ref(i) for i in self._segs.dirty if i in self._segs.segs]
            self._segs.dirty = set()
            return records, dirty, self._segs.retired_pending()

    def _persist(self, records: list[Record], dirty: list[Segment]
                 ) -> tuple[list[Record], StoreIOError | None]:
        """Steps 1 and 2: the records left for the journal, and the first failure."""
        failure: StoreIOError | None = None
        for seg in dirty:
            try:
                self.files.fdatasync(seg.fd)
            except StoreIOError as exc:
                failure = failure or exc
                with self._lock:
                    self._segs.break_(seg)
        by_seg: dict[int, list[BlockEntry]] = {}
        for r in records:
            if isinstance(r, BlockEntry):
                by_seg.setdefault(r.seg, []).append(r)
        lost: set[int] = set()
        unmoved: set[int] = set()  # seqs of the records moves back to their source keep
        for seg_id, puts in by_seg.items():
            target = self._segs.segs.get(seg_id)
            if target is None or target.broken:
                lost.update(self._unrecorded(target, puts, unmoved))
                continue
            target.records_unsynced = True
            try:
                target.records.append(encode_put(r, seg_id) for r in puts)
            except StoreIOError as exc:  # the journal still records them: rewrite it later
                failure = failure or exc
                target.records_stale = True
        if lost:  # a block moved back is no longer at the lost record: not dropped
            self._drop([r for r in records if isinstance(r, BlockEntry) and r.seq in lost])
        return [r for r in records if r.seq not in (lost if isinstance(r, BlockEntry)
                                                    else unmoved)], failure

    def _unrecorded(self, target: Segment | None, puts: list[BlockEntry],
                    unmoved: set[int]) -> set[int]:
        """The seqs of ``puts`` (in record order) whose bytes a failed sync of their segment
        may have lost: each but a retag of a record synced before, which the journal alone
        carries until a snapshot rewrites the segment's record log. A block compaction
        copied there goes back to its source; the seq of the source's record, which stays,
        is added to ``unmoved``."""
        lost: set[int] = set()
        with self._lock:
            for r in puts:
                ended = self._retags.get(r.seq)
                source = self._moves.pop(r.seq, None)
                if target is not None and ended is not None and ended not in lost:
                    target.records_stale = True
                    continue
                lost.add(r.seq)
                self._retags.pop(r.seq, None)
                if source is not None and self._index.get(r.key) is r:
                    self._index.unmove(r, source)
                    self._segs.unmove(r, source)
                    unmoved.add(source.seq)
        return lost

    def _forget_retags(self, records: list[Record]) -> None:
        with self._lock:
            for r in records:
                self._retags.pop(r.seq, None)
                self._moves.pop(r.seq, None)

    def _sync_records(self) -> StoreIOError | None:
        """Make every record log durable before a snapshot lets the journal go (see above);
        a sync that failed (its log rewritten instead) is returned, to be raised."""
        failure: StoreIOError | None = None
        with self._lock:
            todo = [self._segs.ref(s.id) for s in self._segs.segs.values()
                    if s.records_unsynced or s.records_stale]
        try:
            for seg in todo:
                if not seg.records_stale:
                    try:
                        seg.records.sync()
                        seg.records_unsynced = False
                        continue
                    except StoreIOError as exc:
                        failure = failure or exc
                        seg.records_stale = True  # its unsynced pages may be gone: rewrite
                with self._lock:
                    live = [self._index.entries[k] for k in seg.keys]
                seg.records.restart(seg.id, b"".join(encode_put(e, seg.id) for e in live))
                seg.records_unsynced = seg.records_stale = False
        finally:
            with self._lock:
                for seg in todo:
                    self._segs.unref(seg)
        return failure

    def _restore(self, records: list[Record], dirty: list[Segment]) -> None:
        with self._lock:
            self.pending[:0] = records
            self._segs.dirty.update(s.id for s in dirty if not s.broken)
            for seg in dirty:
                self._segs.unref(seg)

    def _settle(self, dirty: list[Segment], retired: list[Segment]) -> None:
        with self._lock:
            for seg in dirty:
                self._segs.unref(seg)
            self._segs.mark_durable(retired)

    def close(self) -> None:
        self.journal.close()


def _encode(record: Record, gen: int) -> bytes:
    return encode_del(record, gen) if isinstance(record, RecordDel) else encode_put(record, gen)
