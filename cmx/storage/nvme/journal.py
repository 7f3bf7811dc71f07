"""Record logs: the index journal and each segment's own record log.

A record log is a file of a 64-byte header (magic, format version, seed, XXH3 of the header)
then records (``records.py``) sealed with that seed. Two kinds exist:

- the journal (``journal.log``, seed = generation): the index changes since the last snapshot.
  A snapshot restarts it with the next generation (temp file, fsync, rename), carrying over
  the DEL records of dead blocks whose records still lie in live segments (``tombstones``),
  so that a store that loses its snapshot never brings a deleted block back.
- a segment's record log (``seg-<id>.rec``, seed = segment id): a PUT for each block written
  to the segment, so the index can be rebuilt from the segments alone.

Appends are written at the log's known end, never with O_APPEND: a write that fails part-way
is cut back (truncate) and, if even that fails, the next append overwrites the torn bytes,
so no acknowledged record ever sits behind garbage. Replay stops at the first record that
does not parse: the torn tail of a crash, which ``open_append`` cuts.

Records are appended only after the data they describe was written and fdatasync'ed (the
store's flush), so a replayed PUT never points at unwritten data. Not thread-safe: the store
calls a log under its flush lock.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator

import xxhash

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.records import RECORD_BYTES, RecordDel, decode, encode_del, encode_put

__all__ = ["JOURNAL_MAGIC", "RECORD_BYTES", "SEGMENT_MAGIC", "Journal", "RecordDel", "RecordLog",
           "encode_del", "encode_put"]

JOURNAL_MAGIC = b"CMXJRNL1"
SEGMENT_MAGIC = b"CMXSEGR1"
_HEADER = struct.Struct("<8sIQ")  # magic, version, seed; + 8-byte xxh3 -> padded to 64
_HEADER_BYTES = 64
_VERSION = 1


def _header(magic: bytes, seed: int) -> bytes:
    head = _HEADER.pack(magic, _VERSION, seed)
    head += xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")
    return head.ljust(_HEADER_BYTES, b"\0")


class RecordLog:
    """One record log file (see the module docstring)."""

    def __init__(self, path: str, files: FileOps, magic: bytes = JOURNAL_MAGIC) -> None:
        self.path = path
        self.files = files
        self.magic = magic
        self.generation = 0  # the seed records are sealed with
        self.records = 0  # records appended since the header was written
        self.size = 0  # bytes of header and whole records: where the next append goes
        self.valid_bytes = 0  # after replay: the length of the parsed prefix
        self._fd = -1

    # -- opening and replay --------------------------------------------------------------------

    def read(self) -> tuple[int, bytes] | None:
        """(seed, whole file) if the file exists with a valid header, else None."""
        data = self.files.read_file(self.path)
        if data is None or len(data) < _HEADER_BYTES:
            return None
        magic, version, seed = _HEADER.unpack_from(data)
        crc = int.from_bytes(data[_HEADER.size : _HEADER.size + 8], "little")
        if magic != self.magic or version != _VERSION or crc != xxhash.xxh3_64_intdigest(
            data[: _HEADER.size]
        ):
            return None
        return seed, data

    def read_generation(self) -> int | None:
        got = self.read()
        return None if got is None else got[0]

    def replay(self, gen: int, data: bytes | None = None) -> Iterator[BlockEntry | RecordDel]:
        """Yield the complete records of a generation-``gen`` log; stops at a torn tail.

        After the iterator is exhausted, ``valid_bytes`` is the length of the parsed prefix
        and ``records`` the number of records in it.
        """
        if data is None:
            got = self.read()
            data = got[1] if got is not None else b""
        self.valid_bytes = min(_HEADER_BYTES, len(data))
        self.records = 0
        for end, rec in decode(data, _HEADER_BYTES, gen):
            self.records += (end - self.valid_bytes) // RECORD_BYTES
            self.valid_bytes = end
            yield rec

    # -- writing -------------------------------------------------------------------------------

    def open_append(self, gen: int, valid_bytes: int) -> None:
        """Continue a replayed log of generation ``gen``, cutting a torn tail."""
        self._close_fd()
        self._fd = self.files.open(self.path, os.O_WRONLY)
        self.files.ftruncate(self._fd, valid_bytes)
        self.files.fsync(self._fd)
        self.generation = gen
        self.size = valid_bytes

    def create(self, gen: int) -> None:
        """A new, empty log of generation ``gen`` in place (a segment's, made with it)."""
        self._close_fd()
        self._fd = self.files.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.generation = gen
        self.records = 0
        self.size = 0
        self._write(_header(self.magic, gen))

    def restart(self, gen: int, carried: bytes = b"") -> None:
        """Replace the log by one of generation ``gen`` holding only ``carried`` records
        (temp file, fsync, rename, directory fsync)."""
        self._close_fd()
        tmp = self.path + ".tmp"
        fd = self.files.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self.files.pwrite_all(fd, _header(self.magic, gen) + carried, 0)
            self.files.fsync(fd)
        finally:
            self.files.close(fd)
        self.files.replace(tmp, self.path)
        self.files.fsync_dir(os.path.dirname(self.path))
        self._fd = self.files.open(self.path, os.O_WRONLY)
        self.generation = gen
        self.records = 0
        self.size = _HEADER_BYTES + len(carried)

    def append(self, records: Iterable[bytes]) -> None:
        blob = b"".join(records)
        self._write(blob)
        self.records += len(blob) // RECORD_BYTES

    def _write(self, blob: bytes) -> None:
        try:
            self.files.pwrite_all(self._fd, blob, self.size)
        except BaseException:
            try:  # cut the torn bytes; if this fails too, the next append overwrites them
                self.files.ftruncate(self._fd, self.size)
            except OSError:
                pass
            raise
        self.size += len(blob)

    def sync(self) -> None:
        self.files.fsync(self._fd)

    def close(self) -> None:
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            self.files.close(self._fd)
            self._fd = -1


class Journal(RecordLog):
    """The index journal (``journal.log``); its seed is the generation."""

    def __init__(self, path: str, files: FileOps | None = None) -> None:
        super().__init__(path, files or FileOps(), JOURNAL_MAGIC)
