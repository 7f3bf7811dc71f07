"""Reopening a store directory: the index from the snapshot and journal, or rebuilt without them.

Normal path (the snapshot is there and passes its checksum):

1. Load the snapshot and replay the journal whose generation continues it, up to its torn
   tail. A journal of an older generation is already contained in the snapshot.
2. Segment files no entry references hold nothing live (the snapshot and journal say so) and
   are deleted, with their record logs and leftover temp files.

Rebuild (the snapshot is missing while segments exist, cut short, or fails its checksum):
logged as an error, then the index is rebuilt from the segments' own record logs and the
journal: for each key the record with the highest sequence number wins, unless a DEL (from
the journal, which carries the DELs of every ended record still on disk) ended it; every
winning block is read back and checked against its checksum. No segment file is deleted at
open: one left with nothing live is retired, and deleted only once the rebuilt snapshot is
durable.

Both paths then make the segment files agree with the index:

3. Drop entries whose segment file is missing or too short (a miss is better than a wrong
   block). Each segment's head becomes the end of its last committed extent and the file is
   truncated there: a write that never committed is discarded, never seen.
4. Each live segment's record log is reopened; a live entry it lacks (a store written before
   record logs existed) is appended, and records no entry owns are remembered as ended
   (``Segment.killed``). Every reopened segment stays sealed: a write granted before the
   reopening may still land past a head set back in step 3, so appends go to a new segment,
   of an id never used before (``segments``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from cmx.checksum import checksum
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.journal import SEGMENT_MAGIC, Journal, RecordLog
from cmx.storage.nvme.records import RecordDel, encode_put
from cmx.storage.nvme.segments import Segment, SegmentSet, segment_ids
from cmx.storage.nvme.snapshot import Snapshot, SnapshotDamaged, read_snapshot
from cmx.storage.nvme.staging import alloc_aligned

__all__ = ["Recovered", "recover"]

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    index: dict[bytes, BlockEntry]  # in recency order, oldest first
    journal_gen: int  # generation the journal continues with
    clean: bool  # True when the journal can be appended to as it is (nothing replayed or cut)
    valid_bytes: int  # length of the journal's parsed prefix
    dropped: int  # entries dropped because their data is not on disk or fails its checksum
    next_seq: int  # the next record sequence number
    rebuilt: bool  # the snapshot was missing or damaged and the index rebuilt


def recover(root: str, snapshot_path: str, journal: Journal, segs: SegmentSet,
            files: FileOps) -> Recovered:
    for name in os.listdir(root):
        if name.endswith(".tmp"):
            files.unlink(os.path.join(root, name))
    ids = segment_ids(root)
    try:
        snap = read_snapshot(files, snapshot_path)
        damage = None if snap is not None or not ids else "is missing"
    except SnapshotDamaged as exc:
        snap, damage = None, str(exc)
    unknown: set[int] = set()
    if damage is None:
        index, gen, clean, valid = _replay(snap, journal)
        next_seq = max([snap.next_seq if snap else 1] + [e.seq + 1 for e in index.values()])
    else:
        log.error("%s: the index snapshot %s; rebuilding the index from the journal and the "
                  "segments' record logs (no data is deleted)", root, damage)
        index, gen, valid, unknown = _rebuild(root, ids, journal, segs, files)
        clean = False
        next_seq = max([1] + [e.seq + 1 for e in index.values()])
    # Past every id handed out before, whose file a crash may have left deleted while a
    # write granted in it is still under way (``segments``: ids are never reused).
    segs.next_id = max([snap.next_segment if snap else 1, segs.reserved_ids()]
                       + [i + 1 for i in ids])
    segs.reserve(segs.next_id, again=True)
    index, dropped = _attach(root, [i for i in ids if i not in unknown], index, segs,
                             damage is not None, unknown)
    # Entries from before sequence numbers existed get theirs now (recorded below).
    for key, entry in index.items():
        if entry.seq == 0:
            index[key] = replace(entry, seq=next_seq)
            next_seq += 1
            clean = False
    clean = _reopen_records(segs, index) and clean
    if dropped:
        log.warning("%s: %d index entries had no data on disk, or data that fails its "
                    "checksum, and were dropped", root, dropped)
    return Recovered(index, gen, clean and not dropped, valid, dropped, next_seq,
                     damage is not None)


def _replay(snap: Snapshot | None, journal: Journal
            ) -> tuple[dict[bytes, BlockEntry], int, bool, int]:
    """Snapshot plus the journal that continues it: (index, generation, clean, valid bytes)."""
    index: dict[bytes, BlockEntry] = {e.key: e for e in snap.entries} if snap else {}
    gen = snap.journal_gen if snap else 0
    got = journal.read()
    clean = got is not None and got[0] == gen
    valid = 0
    if got is not None and (snap is None or got[0] == gen):
        gen, data = got
        for rec in journal.replay(gen, data):
            _apply(index, rec)
        valid = journal.valid_bytes
        clean = clean and journal.records == 0 and valid == len(data)
    elif os.path.exists(journal.path) and snap is not None:
        log.warning("%s has no valid header; the snapshot alone is replayed", journal.path)
    return index, gen, clean, valid


def _apply(index: dict[bytes, BlockEntry], rec: BlockEntry | RecordDel) -> None:
    if isinstance(rec, RecordDel):
        current = index.get(rec.key)
        if current is not None and rec.seq in (0, current.seq):
            del index[rec.key]
    else:
        index[rec.key] = rec  # a move keeps the block's place in recency order


def _rebuild(root: str, ids: list[int], journal: Journal, segs: SegmentSet, files: FileOps
             ) -> tuple[dict[bytes, BlockEntry], int, int, set[int]]:
    """The index from the segments' record logs and the journal: (index, generation, valid
    bytes of the journal, segments without a record log, which are left alone)."""
    best: dict[bytes, BlockEntry] = {}
    ended: set[int] = set()

    def offer(rec: BlockEntry | RecordDel) -> None:
        if isinstance(rec, RecordDel):
            ended.add(rec.seq)
        elif (old := best.get(rec.key)) is None or rec.seq > old.seq:
            best[rec.key] = rec

    unlogged: set[int] = set()
    for seg_id in ids:
        records = RecordLog(segs.records_path(seg_id), files, SEGMENT_MAGIC)
        got = records.read()
        if got is None or got[0] != seg_id:
            unlogged.add(seg_id)
            continue
        for rec in records.replay(seg_id, got[1]):
            offer(rec)
    got = journal.read()
    gen, valid = 0, 0
    if got is not None:
        gen = got[0]
        for rec in journal.replay(gen, got[1]):
            offer(rec)
        valid = journal.valid_bytes
    alive = sorted((e for e in best.values() if e.seq not in ended), key=lambda e: e.seq)
    unknown = unlogged - {e.seg for e in alive}
    for seg_id in sorted(unknown):
        log.error("%s: segment %d has no record log; what it holds cannot be found again "
                  "without the snapshot, and it is left as it is", root, seg_id)
    log.warning("%s: rebuilt %d entries from %d segments (%d records ended)", root,
                len(alive), len(ids), len(ended))
    return {e.key: e for e in alive}, gen, valid, unknown


def _attach(root: str, ids: list[int], index: dict[bytes, BlockEntry], segs: SegmentSet,
            rebuilt: bool, unknown_ids: set[int]) -> tuple[dict[bytes, BlockEntry], int]:
    """Open the segments the index needs and make them agree with it (steps 2-3)."""
    by_seg: dict[int, list[BlockEntry]] = {}
    for entry in index.values():
        by_seg.setdefault(entry.seg, []).append(entry)
    dropped = 0
    for seg_id in ids:
        entries = by_seg.pop(seg_id, [])
        if not entries and not rebuilt:
            segs.files.unlink(segs.path(seg_id))
            if os.path.exists(segs.records_path(seg_id)):
                segs.files.unlink(segs.records_path(seg_id))
            continue
        seg = segs.open(seg_id)
        size = seg.head
        kept = [e for e in entries if e.end <= size and (not rebuilt or _intact(segs, seg, e))]
        for entry in set(entries) - set(kept):
            del index[entry.key]
            dropped += 1
        seg.head = max((e.end for e in kept), default=0)
        if size > seg.head:
            segs.files.ftruncate(seg.fd, seg.head)
        seg.live = sum(e.extent for e in kept)
        seg.keys = {e.key for e in kept}
        seg.sealed = True
        seg.retired = not kept  # a rebuild's empty segment: deleted once the snapshot is durable
    for entries in by_seg.values():  # segment file missing
        for entry in entries:
            del index[entry.key]
            dropped += 1
    for name in os.listdir(root):  # record logs of segments that are gone
        if (name.startswith("seg-") and name.endswith(".rec") and name[4:-4].isdigit()
                and int(name[4:-4]) not in segs.segs and int(name[4:-4]) not in unknown_ids):
            segs.files.unlink(os.path.join(root, name))
    return index, dropped


def _intact(segs: SegmentSet, seg: Segment, entry: BlockEntry) -> bool:
    buf = alloc_aligned(entry.extent)
    try:
        segs.engine.read([(seg.fd, entry.offset, buf)])
    except OSError as exc:
        log.warning("segment %s: reading %s failed: %s", seg.path, entry.key.hex()[:12], exc)
        return False
    return checksum(buf[: entry.length]) == entry.checksum


def _reopen_records(segs: SegmentSet, index: dict[bytes, BlockEntry]) -> bool:
    """Reopen every segment's record log (step 4); False if records had to be added."""
    by_seg: dict[int, list[BlockEntry]] = {}
    for entry in index.values():
        by_seg.setdefault(entry.seg, []).append(entry)
    complete = True
    for seg in segs.segs.values():
        records = seg.records
        got = records.read()
        recorded: set[int] = set()
        if got is not None and got[0] == seg.id:
            for rec in records.replay(seg.id, got[1]):
                if isinstance(rec, BlockEntry):
                    recorded.add(rec.seq)
                    current = index.get(rec.key)
                    if current is None or current.seq != rec.seq:
                        seg.killed[rec.seq] = rec.key
            records.open_append(seg.id, records.valid_bytes)
        else:
            records.create(seg.id)
        missing = [e for e in by_seg.get(seg.id, []) if e.seq not in recorded]
        if missing:
            records.append(encode_put(e, seg.id) for e in missing)
            records.sync()
            complete = False
    return complete
