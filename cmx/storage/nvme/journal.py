"""The index journal: an append-only file of fixed-size, individually checksummed records.

File: a 64-byte header (magic, format version, generation, XXH3 of the header) then records of
``RECORD_BYTES``. Every record ends with the XXH3-64 of its first 120 bytes seeded with the
journal's generation, so a torn or stale record never parses. Kinds:

- PUT: key, parent (optional), segment, offset, length, block checksum, chunk count; followed
  by ceil(chunks / 14) CHUNKS records carrying the chunk checksums. A PUT counts only with all
  of its CHUNKS records.
- DEL: key. The block left the store (deleted, evicted or quarantined).

Replay stops at the first record that does not parse: that is the torn tail of a crash, and
the caller truncates the file there. Records are appended only after the data they describe
was written and fdatasync'ed (the store's flush), so a replayed PUT never points at unwritten
data.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import xxhash

from cmx.storage.nvme.entry import BlockEntry

__all__ = ["RECORD_BYTES", "Journal", "JournalDel", "encode_put", "encode_del"]

RECORD_BYTES = 128
_BODY = RECORD_BYTES - 8
_MAGIC = b"CMXJRNL1"
_HEADER = struct.Struct("<8sIQ")  # magic, version, generation; + 8-byte xxh3 -> padded to 64
_HEADER_BYTES = 64
_VERSION = 1

_PUT, _DEL, _CHUNKS = 1, 2, 3
_HAS_PARENT = 1
_PUT_REC = struct.Struct("<BB2xI32s32sQQQI")  # kind, flags, seg, key, parent, off, len, sum, n
_DEL_REC = struct.Struct("<BB2xI32s")  # kind, flags, seg (unused), key
_CHUNKS_REC = struct.Struct("<BBHI")  # kind, flags, count, first chunk index
_SUMS_PER_REC = (_BODY - _CHUNKS_REC.size) // 8  # 14
_PAD = bytes(_BODY)


@dataclass(frozen=True)
class JournalDel:
    key: bytes


def _seal(body: bytes, gen: int) -> bytes:
    body = body + _PAD[: _BODY - len(body)]
    return body + xxhash.xxh3_64_intdigest(body, seed=gen).to_bytes(8, "little")


def encode_put(entry: BlockEntry, gen: int) -> bytes:
    sums = entry.chunk_sums
    n = len(sums) // 8
    flags = _HAS_PARENT if entry.parent is not None else 0
    out = [
        _seal(
            _PUT_REC.pack(_PUT, flags, entry.seg, entry.key, entry.parent or bytes(32),
                          entry.offset, entry.length, entry.checksum, n),
            gen,
        )
    ]
    for first in range(0, n, _SUMS_PER_REC):
        count = min(_SUMS_PER_REC, n - first)
        body = _CHUNKS_REC.pack(_CHUNKS, 0, count, first) + sums[first * 8 : (first + count) * 8]
        out.append(_seal(body, gen))
    return b"".join(out)


def encode_del(key: bytes, gen: int) -> bytes:
    return _seal(_DEL_REC.pack(_DEL, 0, 0, key), gen)


class Journal:
    """The journal file. Not thread-safe: the store calls it under its flush lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.generation = 0
        self.records = 0  # records appended since the header was written
        self._fd = -1

    # -- opening and replay --------------------------------------------------------------------

    def read_generation(self) -> int | None:
        """The generation in the file's header, or None if there is no valid journal."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(_HEADER_BYTES)
        except FileNotFoundError:
            return None
        if len(head) < _HEADER_BYTES:
            return None
        magic, version, gen = _HEADER.unpack_from(head)
        crc = int.from_bytes(head[_HEADER.size : _HEADER.size + 8], "little")
        if magic != _MAGIC or version != _VERSION or crc != xxhash.xxh3_64_intdigest(
            head[: _HEADER.size]
        ):
            return None
        return gen

    def replay(self, gen: int) -> Iterator[BlockEntry | JournalDel]:
        """Yield the complete records of a generation-``gen`` journal; stops at a torn tail.

        After the iterator is exhausted, ``valid_bytes`` is the length of the parsed prefix.
        """
        with open(self.path, "rb") as f:
            data = f.read()
        pos = _HEADER_BYTES
        self.valid_bytes = pos
        self.records = 0
        while pos + RECORD_BYTES <= len(data):
            rec = _parse(data, pos, gen)
            if rec is None:
                return
            kind, fields = rec
            used = 1
            if kind == _DEL:
                yield JournalDel(fields[3])
            elif kind == _PUT:
                _, flags, seg, key, parent, off, length, checksum, n = fields
                sums = _read_chunks(data, pos + RECORD_BYTES, gen, n)
                if sums is None:
                    return
                used += -(-n // _SUMS_PER_REC)
                yield BlockEntry(key, parent if flags & _HAS_PARENT else None, seg, off, length,
                                 checksum, sums)
            else:
                return  # a CHUNKS record without its PUT: not something we write
            pos += used * RECORD_BYTES
            self.valid_bytes = pos
            self.records += used

    # -- writing -------------------------------------------------------------------------------

    def open_append(self, gen: int, valid_bytes: int) -> None:
        """Continue a replayed journal of generation ``gen``, cutting a torn tail."""
        self._close_fd()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.ftruncate(self._fd, valid_bytes)
        os.fsync(self._fd)
        self.generation = gen

    def restart(self, gen: int) -> None:
        """Replace the journal by an empty one of generation ``gen`` (temp file, fsync, rename)."""
        self._close_fd()
        tmp = self.path + ".tmp"
        head = _HEADER.pack(_MAGIC, _VERSION, gen)
        head += xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, head.ljust(_HEADER_BYTES, b"\0"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(self.path))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.generation = gen
        self.records = 0

    def append(self, records: Iterable[bytes]) -> None:
        blob = b"".join(records)
        view = memoryview(blob)
        while view:
            view = view[os.write(self._fd, view):]
        self.records += len(blob) // RECORD_BYTES

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _parse(data: bytes, pos: int, gen: int) -> tuple[int, tuple] | None:
    body = data[pos : pos + _BODY]
    crc = int.from_bytes(data[pos + _BODY : pos + RECORD_BYTES], "little")
    if crc != xxhash.xxh3_64_intdigest(body, seed=gen):
        return None
    kind = body[0]
    if kind == _PUT:
        return kind, _PUT_REC.unpack_from(body)
    if kind == _DEL:
        return kind, _DEL_REC.unpack_from(body)
    if kind == _CHUNKS:
        return kind, _CHUNKS_REC.unpack_from(body)
    return None


def _read_chunks(data: bytes, pos: int, gen: int, n: int) -> bytes | None:
    sums = []
    for first in range(0, n, _SUMS_PER_REC):
        if pos + RECORD_BYTES > len(data):
            return None
        rec = _parse(data, pos, gen)
        if rec is None or rec[0] != _CHUNKS:
            return None
        _, _, count, at = rec[1]
        if at != first or count != min(_SUMS_PER_REC, n - first):
            return None
        start = pos + _CHUNKS_REC.size
        sums.append(data[start : start + count * 8])
        pos += RECORD_BYTES
    return b"".join(sums)


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
