"""Read planning for slice reads: many small byte ranges become few large, verifiable I/Os.

Each requested range is first widened to whole chunks (``CHUNK_BYTES``) of its block, because
only whole chunks can be checked against their checksums. The widened ranges are sorted by
(segment, offset) and overlapping or touching ones merge into runs. Runs in the same segment
separated by a gap of at most ``max_gap`` then merge too, smallest gaps first, while the
total read stays within ``max_amplification`` x the requested bytes: one I/O instead of two
for a little extra data. Runs become I/Os of at most ``max_io`` bytes, each landing at its own
place in one buffer, so every run is contiguous in the buffer and a request is one slice of it.

The bound holds for the gap merging; the widening to chunks is the price of verification and
is not capped (512 bytes alone from a chunk reads 128 KiB). Requests of whole head runs in a
head-major block, the access this serves, are chunk-sized or larger and pay nothing for it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from cmx.storage.nvme.chunks import CHUNK_BYTES

__all__ = ["ReadPlan", "plan_reads"]


@dataclass(frozen=True)
class ReadPlan:
    runs: list[tuple[int, int, int, int]]  # (segment, start, end, buffer offset), sorted
    ios: list[tuple[int, int, int, int]]  # (segment, file offset, length, buffer offset)
    nbytes: int  # buffer size: the bytes read from disk

    def locate(self, seg: int, pos: int) -> int:
        """Buffer offset of byte ``pos`` of segment ``seg`` (which the plan must cover)."""
        i = bisect.bisect_right(self.runs, (seg, pos, float("inf"))) - 1
        s, start, end, at = self.runs[i]
        if s != seg or not start <= pos < end:
            raise KeyError(f"segment {seg} offset {pos} is not in the plan")
        return at + pos - start


def plan_reads(
    ranges: Iterable[tuple[int, int, int]],
    requested: int,
    max_io: int = 4 << 20,
    max_amplification: float = 1.5,
    max_gap: int = CHUNK_BYTES,
) -> ReadPlan:
    """Plan reads of ``ranges`` ((segment, start, end), chunk-aligned, may overlap)."""
    merged: list[list[int]] = []
    for seg, start, end in sorted(ranges):
        if merged and merged[-1][0] == seg and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([seg, start, end])
    budget = max_amplification * requested - sum(end - start for _, start, end in merged)
    gaps = sorted(
        (merged[i + 1][1] - merged[i][2], i)
        for i in range(len(merged) - 1)
        if merged[i][0] == merged[i + 1][0] and merged[i + 1][1] - merged[i][2] <= max_gap
    )
    join = set()
    for gap, i in gaps:
        if gap > budget:
            break
        budget -= gap
        join.add(i)
    runs: list[tuple[int, int, int, int]] = []
    ios: list[tuple[int, int, int, int]] = []
    at = 0
    i = 0
    while i < len(merged):
        seg, start, end = merged[i]
        while i in join:
            i += 1
            end = merged[i][2]
        runs.append((seg, start, end, at))
        for pos in range(start, end, max_io):
            ios.append((seg, pos, min(max_io, end - pos), at + pos - start))
        at += end - start
        i += 1
    return ReadPlan(runs, ios, at)
