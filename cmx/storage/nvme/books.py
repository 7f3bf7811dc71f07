"""The books of the NVMe store: lookups, commits, removals, counters, stats and self-checks.

Every method here reads or changes the books under ``_lock`` and does no I/O, except
``check_integrity`` which also compares the books with the segment files' sizes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cmx.checksum import checksum
from cmx.keys import BlockHash
from cmx.storage.base import EventKind, StoreStats
from cmx.storage.nvme.chunks import block_sums
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.records import RecordDel
from cmx.storage.nvme.segments import Segment
from cmx.storage.nvme.state import NvmeState

__all__ = ["BooksMixin"]


class BooksMixin(NvmeState):
    """The books part of NvmeStore (see state.py for what the parts share)."""

    def _lookup(self, key: bytes, min_room: int | None = None) -> tuple[BlockEntry, Segment] | None:
        """The entry of ``key`` and its segment with an I/O ref held; None (a miss) if absent."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            if min_room is not None and min_room < entry.length:
                raise ValueError(f"buffer of {min_room} bytes < block of {entry.length}")
            return entry, self._segs.ref(entry.seg)

    def _lookup_runs(
        self, reqs: Sequence[tuple[bytes, int, int]]
    ) -> tuple[list[BlockEntry | None], dict[int, Segment]]:
        """Entries (None for misses) and their segments, one I/O ref each, for slice reads."""
        with self._lock:
            entries = [self._index.get(key) for key, _, _ in reqs]
            for (key, off, length), entry in zip(reqs, entries):
                if entry is not None and (off < 0 or length < 0 or off + length > entry.length):
                    raise ValueError(f"range [{off}, {off + length}) is outside block "
                                     f"{key.hex()[:12]} of {entry.length} bytes")
            self._counts["misses"] += len({k for (k, _, _), e in zip(reqs, entries) if e is None})
            segs = {e.seg: self._segs.ref(e.seg) for e in entries if e is not None}
            return entries, segs

    def _release(self, seg: Segment) -> None:
        with self._lock:
            self._segs.unref(seg)

    def _verified(self, entry: BlockEntry, payload: np.ndarray) -> bool:
        """Check a whole block read; count the hit, or quarantine and count the miss."""
        if checksum(payload) != entry.checksum:
            self._quarantine(entry)
            with self._lock:
                self._counts["misses"] += 1
            return False
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += entry.length
            self._counts["bytes_requested"] += entry.length
            self._counts["bytes_read_from_disk"] += entry.extent
            self._policy.touch(entry.key)
        return True

    def _quarantine(self, entry: BlockEntry) -> None:
        with self._lock:
            if self._index.get(entry.key) is entry:
                self._remove(entry)
                self._counts["quarantined"] += 1

    def _remove(self, entry: BlockEntry) -> None:
        """Drop a committed block from the books (caller holds _lock); its bytes become dead."""
        del self._index[entry.key]
        self._policy.remove(entry.key)
        self._segs.drop(entry.seg, entry.key, entry.extent, entry.seq)
        self._pending.append(RecordDel(entry.key, entry.seq, entry.seg))
        self._emit(EventKind.REMOVED, BlockHash(entry.key), entry.length, entry.checksum)

    def _finish_put(self, key: bytes, seg: Segment, ext: int, entry: BlockEntry | None) -> None:
        """Commit a written block, or turn a failed write's reservation into dead space."""
        with self._lock:
            self._reserving.discard(key)
            self._segs.finish_write(seg, ext, None if entry is None else key)
            if entry is None:
                return
            entry = replace(entry, seq=self._next_seq)
            self._next_seq += 1
            self._index[key] = entry
            self._policy.insert(key, entry.parent)
            self._pending.append(entry)
            self._counts["bytes_written"] += entry.length
            self._emit(EventKind.STORED, BlockHash(entry.key), entry.length, entry.checksum)

    @staticmethod
    def _sums(view: np.ndarray) -> tuple[int, bytes]:
        return block_sums(view)

    # -- stats and self-checks -----------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._op(), self._lock:
            c = self._counts
            requested = c["bytes_requested"]
            extra: dict[str, object] = {
                "io_engine": self._engine.name,
                "direct_io": self._segs.direct,
                "queue_depth": self._engine.queue_depth,
                "io_bytes": self._engine.io_bytes,
                "segments": len(self._segs.segs),
                "segment_bytes": self._segs.segment_bytes,
                "disk_bytes": self._segs.disk_bytes,
                "file_bytes": self._segs.file_bytes,
                "dead_bytes": self._segs.dead_bytes,
                "compactions": c["compactions"],
                "compacted_bytes": c["compacted_bytes"],
                "journal_records": self._journal.records,
                "io_size_histogram": self._engine.io_sizes("read"),  # read I/Os by size
                "write_io_size_histogram": self._engine.io_sizes("write"),
                "bytes_requested": requested,
                "bytes_read_from_disk": c["bytes_read_from_disk"],
                "read_amplification": c["bytes_read_from_disk"] / requested if requested else 0.0,
            }
            return StoreStats(
                capacity_bytes=self._capacity,
                used_bytes=self._segs.used_bytes,
                blocks=len(self._index),
                pinned=sum(1 for k in self._pins if k in self._index),
                hits=c["hits"],
                misses=c["misses"],
                evictions=c["evictions"],
                quarantined=c["quarantined"],
                bytes_written=c["bytes_written"],
                bytes_read=c["bytes_read"],
                extra=extra,
            )

    def _count_runs(self, entries: list[BlockEntry | None], bad: set[bytes], requested: int,
                    read: int) -> None:
        with self._lock:
            c = self._counts
            c["bytes_requested"] += requested
            c["bytes_read_from_disk"] += read
            for entry in {e.key: e for e in entries if e is not None}.values():
                if entry.key in bad:
                    c["misses"] += 1
                else:
                    c["hits"] += 1
                    self._policy.touch(entry.key)
            c["bytes_read"] += requested

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if index, segments, files or policy disagree."""
        with self._op(), self._lock:
            self._check_segments()
            used, disk = self._segs.used_bytes, self._segs.file_bytes
            if used > self._capacity:
                raise AssertionError(f"used {used} > capacity {self._capacity}")
            limit = self._capacity + self._segs.segment_bytes
            if disk > limit:
                raise AssertionError(f"disk {disk} > capacity {self._capacity} + segment "
                                     f"{self._segs.segment_bytes}")
            if len(self._policy) != len(self._index):
                raise AssertionError(f"policy holds {len(self._policy)}, index {len(self._index)}")
            missing = [k for k in self._index if k not in self._policy]
            if missing:
                raise AssertionError(f"{len(missing)} indexed keys unknown to the policy")
            if any(n <= 0 for n in self._pins.values()):
                raise AssertionError(f"non-positive pin counts: {sorted(self._pins.values())}")
            self._policy.check_integrity()

    def _check_segments(self) -> None:
        by_seg: dict[int, list[BlockEntry]] = {}
        for entry in self._index.values():
            if entry.seg not in self._segs.segs:
                raise AssertionError(f"{entry.key.hex()[:12]} in missing segment {entry.seg}")
            by_seg.setdefault(entry.seg, []).append(entry)
        for seg in self._segs.segs.values():
            entries = sorted(by_seg.get(seg.id, []), key=lambda e: e.offset)
            live = sum(e.extent for e in entries)
            if seg.dead < 0 or seg.live != live:
                raise AssertionError(
                    f"segment {seg.id}: live {seg.live} (index {live}) + pending {seg.pending} "
                    f"+ dead {seg.dead} != head {seg.head}"
                )
            if {e.key for e in entries} != seg.keys:
                raise AssertionError(
                    f"segment {seg.id}: {len(seg.keys)} keys, index {len(entries)}"
                )
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
