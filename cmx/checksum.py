"""Block checksums: XXH3-64 over the payload bytes.

XXH3 runs at ~25 GB/s on one core here, about twice memcpy, so verifying every block read from
NVMe or the network costs a fraction of moving it. It detects corruption, not tampering: keys,
not checksums, carry the cryptographic guarantee.
"""

from __future__ import annotations

from typing import NewType

import xxhash

from cmx.buffers import Buffer, as_bytes_view

__all__ = ["Checksum", "ChecksumStream", "checksum"]

Checksum = NewType("Checksum", int)


def checksum(data: Buffer) -> Checksum:
    """XXH3-64 (seed 0) of the bytes of ``data`` as an unsigned 64-bit int."""
    return Checksum(xxhash.xxh3_64_intdigest(as_bytes_view(data).data))


class ChecksumStream:
    """The checksum of a block fed piece by piece, in order, as its bytes arrive: equal to
    ``checksum`` of the whole. Feeding each piece right after it lands reads it from the
    CPU's cache instead of reading the whole block back from memory afterwards."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def feed(self, data: Buffer) -> None:
        self._state.update(as_bytes_view(data).data)

    def value(self) -> Checksum:
        return Checksum(self._state.intdigest())
