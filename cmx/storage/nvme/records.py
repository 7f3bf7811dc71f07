"""Index records: the fixed-size, checksummed records of the journal and the segment logs.

Every record is ``RECORD_BYTES`` long and ends with the XXH3-64 of its first 120 bytes seeded
with its file's seed (the journal's generation, a segment log's segment id), so a torn record,
or one left from another generation or file, never parses. Kinds:

- PUT: key, parent (optional), segment, offset, length, block checksum, chunk count, sequence
  number; then one TAG record if the block has a tag; then ceil(chunks / 14) CHUNKS records
  carrying the chunk checksums. A PUT counts only with all of the records that follow it.
- DEL: key and the sequence number of the record it ends (0: whatever record the key has).
  A block left the store (deleted, evicted, quarantined) or moved (its old record ends).

``decode`` reads records from the start of a buffer and stops at the first that does not
parse: the torn tail of a crash.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from cmx.storage.nvme.entry import BlockEntry

__all__ = ["MAX_TAG_BYTES", "RECORD_BYTES", "RecordDel", "check_tag", "decode", "encode_del",
           "encode_put"]

RECORD_BYTES = 128
_BODY = RECORD_BYTES - 8

_PUT, _DEL, _CHUNKS, _TAG = 1, 2, 3, 4
_HAS_PARENT, _HAS_TAG = 1, 2
# kind, flags, seg, key, parent, offset, length, checksum, chunk count, sequence
_PUT_REC = struct.Struct("<BB2xI32s32sQQQIQ")
_DEL_REC = struct.Struct("<BB2xI32sQ")  # kind, flags, seg, key, sequence
_CHUNKS_REC = struct.Struct("<BBHI")  # kind, flags, count, first chunk index
_TAG_REC = struct.Struct("<BBH")  # kind, flags, tag length; then the tag (UTF-8)
_SUMS_PER_REC = (_BODY - _CHUNKS_REC.size) // 8  # 14
MAX_TAG_BYTES = _BODY - _TAG_REC.size
_PAD = bytes(_BODY)


@dataclass(frozen=True)
class RecordDel:
    key: bytes
    seq: int = 0  # the record that ends; 0 for any
    seg: int = 0  # the segment that record lies in (0 where unknown)


def check_tag(tag: str) -> None:
    """A tag fits one TAG record; anything else is a ValueError before any change."""
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, got {type(tag).__name__}")
    if len(tag.encode()) > MAX_TAG_BYTES:
        raise ValueError(f"tag of {len(tag.encode())} bytes; at most {MAX_TAG_BYTES}")


def _seal(body: bytes, seed: int) -> bytes:
    body = body + _PAD[: _BODY - len(body)]
    return body + xxhash.xxh3_64_intdigest(body, seed=seed).to_bytes(8, "little")


def encode_put(entry: BlockEntry, seed: int) -> bytes:
    sums = entry.chunk_sums
    n = len(sums) // 8
    tag = entry.tag.encode()
    if len(tag) > MAX_TAG_BYTES:
        raise ValueError(f"tag of {len(tag)} bytes; at most {MAX_TAG_BYTES}")
    flags = (_HAS_PARENT if entry.parent is not None else 0) | (_HAS_TAG if tag else 0)
    out = [
        _seal(
            _PUT_REC.pack(_PUT, flags, entry.seg, entry.key, entry.parent or bytes(32),
                          entry.offset, entry.length, entry.checksum, n, entry.seq),
            seed,
        )
    ]
    if tag:
        out.append(_seal(_TAG_REC.pack(_TAG, 0, len(tag)) + tag, seed))
    for first in range(0, n, _SUMS_PER_REC):
        count = min(_SUMS_PER_REC, n - first)
        body = _CHUNKS_REC.pack(_CHUNKS, 0, count, first) + sums[first * 8 : (first + count) * 8]
        out.append(_seal(body, seed))
    return b"".join(out)


def encode_del(rec: RecordDel, seed: int) -> bytes:
    return _seal(_DEL_REC.pack(_DEL, 0, rec.seg, rec.key, rec.seq), seed)


def decode(data: bytes, pos: int, seed: int) -> Iterator[tuple[int, BlockEntry | RecordDel]]:
    """Yield (end offset, record) for each whole record from ``pos``; stop at a torn one."""
    while pos + RECORD_BYTES <= len(data):
        body = _parse(data, pos, seed)
        if body is None:
            return
        kind = body[0]
        if kind == _DEL:
            _, _, seg, key, seq = _DEL_REC.unpack_from(body)
            pos += RECORD_BYTES
            yield pos, RecordDel(key, seq, seg)
            continue
        if kind != _PUT:
            return  # a TAG or CHUNKS record without its PUT: not something we write
        _, flags, seg, key, parent, off, length, checksum, n, seq = _PUT_REC.unpack_from(body)
        pos += RECORD_BYTES
        tag = ""
        if flags & _HAS_TAG:
            tag_body = _parse(data, pos, seed) if pos + RECORD_BYTES <= len(data) else None
            if tag_body is None or tag_body[0] != _TAG:
                return
            size = _TAG_REC.unpack_from(tag_body)[2]
            tag = tag_body[_TAG_REC.size : _TAG_REC.size + size].decode(errors="replace")
            pos += RECORD_BYTES
        sums = _read_chunks(data, pos, seed, n)
        if sums is None:
            return
        pos += -(-n // _SUMS_PER_REC) * RECORD_BYTES
        yield pos, BlockEntry(key, parent if flags & _HAS_PARENT else None, seg, off, length,
                              checksum, sums, seq, tag)


def _parse(data: bytes, pos: int, seed: int) -> bytes | None:
    body = data[pos : pos + _BODY]
    crc = int.from_bytes(data[pos + _BODY : pos + RECORD_BYTES], "little")
    if crc != xxhash.xxh3_64_intdigest(body, seed=seed):
        return None
    return body


def _read_chunks(data: bytes, pos: int, seed: int, n: int) -> bytes | None:
    sums = []
    for first in range(0, n, _SUMS_PER_REC):
        if pos + RECORD_BYTES > len(data):
            return None
        body = _parse(data, pos, seed)
        if body is None or body[0] != _CHUNKS:
            return None
        _, _, count, at = _CHUNKS_REC.unpack_from(body)
        if at != first or count != min(_SUMS_PER_REC, n - first):
            return None
        start = _CHUNKS_REC.size
        sums.append(body[start : start + count * 8])
        pos += RECORD_BYTES
    return b"".join(sums)
