"""Slice reads: exact byte ranges of blocks, verified chunk by chunk, read as few large I/Os.

``books.lookup_runs`` gives the entries and segment references, ``reads.plan_reads`` the
I/Os, ``ExtentIo`` moves them, and ``books.count_runs`` / ``books.quarantine`` take the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from cmx.keys import check_key
from cmx.storage.nvme.books import NvmeBooks
from cmx.storage.nvme.chunks import CHUNK_BYTES
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.reads import ReadPlan, plan_reads
from cmx.storage.nvme.staging import alloc_aligned

__all__ = ["RunRequest", "SliceReader"]

RunRequest = tuple[bytes, int, int]  # (key, offset in the block, length)


class SliceReader:
    def __init__(self, books: NvmeBooks, io: ExtentIo) -> None:
        self._books = books
        self._io = io

    def read_runs(self, requests: Sequence[RunRequest]) -> list[np.ndarray | None]:
        """Exactly ``length`` bytes at ``offset`` of each block; None where the block misses.

        Ranges are widened to whole 128 KiB chunks, each chunk is checked against its stored
        checksum, and neighbouring ranges are read as one I/O (see ``reads.plan_reads``).
        A range past the end of its block raises ValueError. The results are read-only views
        of one read buffer, never copied: together they keep at most the planned read alive
        (the requested bytes x the plan's amplification bound, plus chunk widening).
        """
        reqs = [(check_key(k), int(off), int(length)) for k, off, length in requests]
        results: list[np.ndarray | None] = [None] * len(reqs)
        entries, segs = self._books.lookup_runs(reqs)
        try:
            spans = []
            requested = 0
            for (_, off, length), entry in zip(reqs, entries):
                if entry is not None and length:
                    c0, c1 = off // CHUNK_BYTES, -(-(off + length) // CHUNK_BYTES)
                    end = min(c1 * CHUNK_BYTES, entry.extent)
                    spans.append((entry.seg, entry.offset + c0 * CHUNK_BYTES,
                                  entry.offset + end))
                    requested += length
            plan = plan_reads(spans, requested, max_io=self._io.io_bytes)
            buf = alloc_aligned(plan.nbytes)
            self._io.read(
                [(segs[s].fd, pos, buf[at : at + n]) for s, pos, n, at in plan.ios]
            )
        finally:
            for seg in segs.values():
                self._books.release(seg)
        bad = self._check_chunks(reqs, entries, plan, buf)
        buf.flags.writeable = False
        for i, ((_, off, length), entry) in enumerate(zip(reqs, entries)):
            if entry is None or entry.key in bad:
                continue
            if not length:
                results[i] = np.empty(0, np.uint8)
                continue
            at = plan.locate(entry.seg, entry.offset + off)
            results[i] = buf[at : at + length]
        self._books.count_runs(entries, bad, requested, plan.nbytes)
        return results

    def _check_chunks(self, reqs: Sequence[RunRequest], entries: list[BlockEntry | None],
                      plan: ReadPlan, buf: np.ndarray) -> set[bytes]:
        """Keys of blocks with a chunk that fails its checksum (they are quarantined)."""
        done: set[tuple[bytes, int]] = set()
        bad: dict[bytes, BlockEntry] = {}
        for (_, off, length), entry in zip(reqs, entries):
            if entry is None or not length or entry.key in bad:
                continue
            sums = np.frombuffer(entry.chunk_sums, dtype="<u8")
            for c in range(off // CHUNK_BYTES, -(-(off + length) // CHUNK_BYTES)):
                if (entry.key, c) in done:
                    continue
                done.add((entry.key, c))
                start = c * CHUNK_BYTES
                at = plan.locate(entry.seg, entry.offset + start)
                n = min(CHUNK_BYTES, entry.extent - start)
                if xxhash.xxh3_64_intdigest(buf[at : at + n].data) != int(sums[c]):
                    bad[entry.key] = entry
                    break
        for entry in bad.values():
            self._books.quarantine(entry)
        return set(bad)
