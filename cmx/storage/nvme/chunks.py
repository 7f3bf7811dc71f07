"""Extents and chunk checksums of a block on disk.

A block of ``length`` payload bytes occupies an *extent* of ``extent_bytes(length)`` bytes: the
payload padded with zeros to the next 4 KiB, since O_DIRECT moves whole 4 KiB pages.

Besides the XXH3-64 of the payload (the block checksum every tier shares), the store keeps one
XXH3-64 per ``CHUNK_BYTES`` chunk of the padded extent. A slice read cannot check the block
checksum without reading the whole block, but it can check every chunk it covers, so slice
reads fetch whole chunks. 128 KiB is the size at which this disk stops paying for small I/O (a
4 KiB read costs 4-7x per byte, a 128 KiB one close to 1x), so rounding slices up to chunks also
gives every slice read an efficient I/O size; the table costs 8 bytes per 128 KiB (2 KiB for a
32 MiB block).
"""

from __future__ import annotations

import numpy as np
import xxhash

from cmx.buffers import ALIGN, align_up

__all__ = ["CHUNK_BYTES", "block_sums", "chunk_count", "chunk_span", "extent_bytes"]

CHUNK_BYTES = 128 * 1024

_ZEROS = bytes(ALIGN)


def extent_bytes(length: int) -> int:
    """Bytes a block of ``length`` payload bytes takes on disk (at least one page)."""
    return max(ALIGN, align_up(length))


def chunk_count(length: int) -> int:
    return -(-extent_bytes(length) // CHUNK_BYTES)


def chunk_span(length: int, index: int) -> tuple[int, int]:
    """(start, end) of chunk ``index`` within the extent of a ``length``-byte block."""
    start = index * CHUNK_BYTES
    return start, min(start + CHUNK_BYTES, extent_bytes(length))


def block_sums(payload: np.ndarray) -> tuple[int, bytes]:
    """(XXH3-64 of the payload, packed little-endian XXH3-64 of each chunk of the padded extent).

    One pass per chunk while it is hot in cache; equal to ``cmx.checksum.checksum(payload)``.
    """
    length = payload.nbytes
    ext = extent_bytes(length)
    whole = xxhash.xxh3_64()
    sums = np.empty(chunk_count(length), dtype="<u8")
    for i in range(len(sums)):
        start, end = i * CHUNK_BYTES, min((i + 1) * CHUNK_BYTES, ext)
        piece = payload[start:min(end, length)].data  # a memoryview: a Buffer, not a copy
        whole.update(piece)
        if end <= length:
            sums[i] = xxhash.xxh3_64_intdigest(piece)
        else:  # the last chunk runs into the zero padding
            h = xxhash.xxh3_64(piece)
            pad = end - max(start, length)
            while pad:
                n = min(pad, ALIGN)
                h.update(_ZEROS[:n])
                pad -= n
            sums[i] = h.intdigest()
    return whole.intdigest(), sums.tobytes()
