"""Index snapshots: every entry in one checksummed Arrow IPC file, replaced atomically.

The file is the Arrow IPC bytes followed by a 32-byte footer (magic, the length of the Arrow
bytes, their XXH3-64), written to ``<path>.tmp``, fsynced, renamed over ``<path>`` and the
directory fsynced, so a reader sees either the old snapshot or the new one. Schema metadata
carries ``journal_gen`` (the journal generation that continues this snapshot),
``next_segment`` (segment ids are never reused while a record may still name them) and
``next_seq`` (record sequence numbers only grow).

``read_snapshot`` returns None for a missing file and raises ``SnapshotDamaged`` for one that
is cut short, fails its checksum or does not parse: the store then rebuilds its index from the
journal and the segments' record logs (``recovery.py``). A snapshot written before the footer
existed (format 1) is still read, unchecked.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.files import FileOps

__all__ = ["Snapshot", "SnapshotDamaged", "read_snapshot", "write_snapshot"]

_FORMAT = b"cmx-nvme-index-2"
_LEGACY = b"cmx-nvme-index-1"
_FOOTER = struct.Struct("<8sQQ8x")  # magic, Arrow bytes, XXH3-64 of them
_FOOTER_MAGIC = b"CMXSNAP2"
_COLUMNS = [
    ("key", pa.binary(32)),
    ("parent", pa.binary(32)),  # null for a first block
    ("seg", pa.uint32()),
    ("offset", pa.uint64()),
    ("length", pa.uint64()),
    ("checksum", pa.uint64()),
    ("chunk_sums", pa.binary()),
    ("seq", pa.uint64()),
    ("tag", pa.string()),
]
_SCHEMA = pa.schema(_COLUMNS)


class SnapshotDamaged(ValueError):
    """The snapshot file exists but cannot be trusted (cut short, checksum, format)."""


@dataclass(frozen=True)
class Snapshot:
    entries: list[BlockEntry]  # in index (insertion) order
    journal_gen: int
    next_segment: int
    next_seq: int


def write_snapshot(files: FileOps, path: str, entries: Iterable[BlockEntry], journal_gen: int,
                   next_segment: int, next_seq: int) -> None:
    rows = list(entries)
    columns = [pa.array([getattr(e, name) for e in rows], kind) for name, kind in _COLUMNS]
    meta = {
        b"format": _FORMAT,
        b"journal_gen": str(journal_gen).encode(),
        b"next_segment": str(next_segment).encode(),
        b"next_seq": str(next_seq).encode(),
    }
    table = pa.Table.from_arrays(columns, schema=_SCHEMA.with_metadata(meta))
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    blob = body + _FOOTER.pack(_FOOTER_MAGIC, len(body), xxhash.xxh3_64_intdigest(body))
    tmp = path + ".tmp"
    fd = files.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        files.pwrite_all(fd, blob, 0)
        files.fsync(fd)
    except BaseException:
        files.close(fd)
        try:
            files.unlink(tmp)
        except OSError:
            pass  # a leftover temp file is removed at the next open
        raise
    files.close(fd)
    files.replace(tmp, path)
    files.fsync_dir(os.path.dirname(path))


def read_snapshot(files: FileOps, path: str) -> Snapshot | None:
    """The snapshot at ``path``; None if there is none; SnapshotDamaged if it is damaged."""
    data = files.read_file(path)
    if data is None:
        return None
    body = _checked_body(path, data)
    try:
        table = ipc.open_file(pa.BufferReader(body)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise SnapshotDamaged(f"index snapshot {path} is unreadable: {exc}") from exc
    meta = table.schema.metadata or {}
    fmt = meta.get(b"format")
    if fmt not in (_FORMAT, _LEGACY) or (fmt == _FORMAT) != (body is not data):
        raise SnapshotDamaged(f"index snapshot {path} has format {fmt!r}")
    names = [n for n, _ in _COLUMNS if n in table.schema.names]
    try:
        cols = [table.column(name).to_pylist() for name in names]
        entries = [BlockEntry(*row) for row in zip(*cols)]
        return Snapshot(entries, int(meta[b"journal_gen"]), int(meta[b"next_segment"]),
                        int(meta.get(b"next_seq", b"1")))
    except (KeyError, TypeError, ValueError, pa.ArrowException) as exc:
        raise SnapshotDamaged(f"index snapshot {path} has bad contents: {exc}") from exc


def _checked_body(path: str, data: bytes) -> bytes:
    """The Arrow bytes of a checksummed snapshot; ``data`` itself for a legacy one."""
    if len(data) >= _FOOTER.size:
        magic, length, digest = _FOOTER.unpack_from(data, len(data) - _FOOTER.size)
        if magic == _FOOTER_MAGIC:
            body = data[: len(data) - _FOOTER.size]
            if length != len(body) or digest != xxhash.xxh3_64_intdigest(body):
                raise SnapshotDamaged(f"index snapshot {path} fails its checksum "
                                      f"({len(body)} bytes, footer says {length})")
            return body
    if data[:6] != b"ARROW1":
        raise SnapshotDamaged(f"index snapshot {path} is cut short or overwritten "
                              f"({len(data)} bytes, no valid footer)")
    return data  # legacy (format 1) or damaged: the format check below decides
