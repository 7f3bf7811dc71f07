"""The books' self-check of segments: index entries against segment books and file sizes."""

from __future__ import annotations

import os

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.index import BlockIndex
from cmx.storage.nvme.segments import SegmentSet

__all__ = ["check_segments"]


def check_segments(index: BlockIndex, segs: SegmentSet) -> None:
    """Raise AssertionError with the numbers where a segment disagrees with the index."""
    by_seg: dict[int, list[BlockEntry]] = {}
    for entry in index.entries.values():
        if entry.seg not in segs.segs:
            raise AssertionError(f"{entry.key.hex()[:12]} in missing segment {entry.seg}")
        by_seg.setdefault(entry.seg, []).append(entry)
    for seg in segs.segs.values():
        entries = sorted(by_seg.get(seg.id, []), key=lambda e: e.offset)
        live = sum(e.extent for e in entries)
        if seg.dead < 0 or seg.live != live:
            raise AssertionError(
                f"segment {seg.id}: live {seg.live} (index {live}) + pending {seg.pending} "
                f"+ dead {seg.dead} != head {seg.head}"
            )
        if {e.key for e in entries} != seg.keys:
            raise AssertionError(f"segment {seg.id}: {len(seg.keys)} keys, index {len(entries)}")
        for a, b in zip(entries, entries[1:]):
            if a.end > b.offset:
                raise AssertionError(f"segment {seg.id}: extents [{a.offset}, {a.end}) and "
                                     f"[{b.offset}, {b.end}) overlap")
        if entries and (entries[0].offset < 0 or entries[-1].end > seg.head):
            raise AssertionError(f"segment {seg.id}: extent ends at {entries[-1].end} past "
                                 f"head {seg.head}")
        size = os.fstat(seg.fd).st_size
        if entries and size < entries[-1].end:
            raise AssertionError(f"segment {seg.id}: file {size} < last extent end "
                                 f"{entries[-1].end}")
        if size > max(seg.head, seg.allocated):
            raise AssertionError(f"segment {seg.id}: file {size} > head {seg.head} and "
                                 f"allocation {seg.allocated}")
