"""BlockEntry: where one committed block lives and how to check it."""

from __future__ import annotations

from dataclasses import dataclass

from cmx.storage.nvme.chunks import extent_bytes

__all__ = ["BlockEntry"]


@dataclass(frozen=True)
class BlockEntry:
    key: bytes  # 32-byte BlockHash
    parent: bytes | None  # key of the previous block of the prefix, for prefix-aware eviction
    seg: int  # segment id (file seg-<id>.dat)
    offset: int  # byte offset of the extent in the segment, 4 KiB-aligned
    length: int  # payload bytes; the extent is padded with zeros to 4 KiB
    checksum: int  # XXH3-64 of the payload
    chunk_sums: bytes  # little-endian XXH3-64 per CHUNK_BYTES of the padded extent
    seq: int = 0  # the store-wide sequence number of this record; a move takes a new one
    tag: str = ""  # the owner's label (a namespace id), kept across reopen; "" for none

    @property
    def extent(self) -> int:
        return extent_bytes(self.length)

    @property
    def end(self) -> int:
        return self.offset + self.extent

    def moved(self, seg: int, offset: int, seq: int) -> BlockEntry:
        return BlockEntry(self.key, self.parent, seg, offset, self.length, self.checksum,
                          self.chunk_sums, seq, self.tag)
