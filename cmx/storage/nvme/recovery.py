"""Reopening a store directory: snapshot + journal replay, then the segment files made to agree.

1. Load the snapshot (if any) and replay the journal whose generation continues it, up to its
   torn tail. A journal of an older generation is already contained in the snapshot.
2. Drop entries whose segment file is missing or too short (never expected: records follow
   fdatasync; but a miss is always better than a wrong block).
3. Each segment's head becomes the end of its last committed extent and the file is truncated
   there: whatever a crash left beyond (a write that never committed) is discarded, never seen.
   Segment files no entry references are deleted, as are leftover temp files. The newest
   segment becomes the active one again, its file allocated ahead as a new one's is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.journal import Journal, JournalDel
from cmx.storage.nvme.segments import SegmentSet, segment_ids
from cmx.storage.nvme.snapshot import read_snapshot

__all__ = ["Recovered", "recover"]

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    index: dict[bytes, BlockEntry]  # in recency order, oldest first
    journal_gen: int  # generation the journal continues with
    clean: bool  # True when the journal can be appended to as it is (nothing replayed or cut)
    valid_bytes: int  # length of the journal's parsed prefix
    dropped: int  # entries dropped because their data is not on disk


def recover(root: str, snapshot_path: str, journal: Journal, segs: SegmentSet) -> Recovered:
    for name in os.listdir(root):
        if name.endswith(".tmp"):
            os.unlink(os.path.join(root, name))
    snap = read_snapshot(snapshot_path)
    index: dict[bytes, BlockEntry] = {e.key: e for e in snap.entries} if snap else {}
    gen = snap.journal_gen if snap else 0
    jgen = journal.read_generation()
    clean = jgen is not None and jgen == gen
    valid = 0
    if jgen is not None and (snap is None or jgen == gen):
        for rec in journal.replay(jgen):
            if isinstance(rec, JournalDel):
                index.pop(rec.key, None)
            else:
                index[rec.key] = rec  # a move keeps the block's place in recency order
        gen = jgen
        valid = journal.valid_bytes
        clean = clean and journal.records == 0 and valid == os.path.getsize(journal.path)

    ids = segment_ids(root)
    segs.next_id = max([snap.next_segment if snap else 1] + [i + 1 for i in ids])
    by_seg: dict[int, list[BlockEntry]] = {}
    for entry in index.values():
        by_seg.setdefault(entry.seg, []).append(entry)
    dropped = 0
    for seg_id in ids:
        entries = by_seg.pop(seg_id, [])
        if not entries:
            os.unlink(segs.path(seg_id))
            continue
        seg = segs.open(seg_id)
        size = seg.head
        for entry in entries:
            if entry.end > size:
                del index[entry.key]
                dropped += 1
        kept = [e for e in entries if e.end <= size]
        seg.head = max((e.end for e in kept), default=0)
        if size > seg.head:
            os.ftruncate(seg.fd, seg.head)
        seg.live = sum(e.extent for e in kept)
        seg.keys = {e.key for e in kept}
        seg.sealed = True
    for entries in by_seg.values():  # segment file missing
        for entry in entries:
            del index[entry.key]
            dropped += 1
    if dropped:
        log.warning("%s: %d index entries had no data on disk and were dropped", root, dropped)
    # Drop segments left empty by the checks above; keep appending to the newest one.
    for seg in list(segs.segs.values()):
        if not seg.keys:
            segs.delete(seg)
    if segs.segs:
        newest = segs.segs[max(segs.segs)]
        if newest.head < segs.segment_bytes:
            segs.activate(newest)
    return Recovered(index, gen, clean and not dropped, valid, dropped)
