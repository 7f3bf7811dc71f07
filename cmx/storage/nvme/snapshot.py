"""Index snapshots: every entry in one Arrow IPC file, replaced atomically.

Written to ``<path>.tmp``, fsynced, renamed over ``<path>`` and the directory fsynced, so a
reader sees either the old snapshot or the new one. Schema metadata carries ``journal_gen``
(the journal generation that continues this snapshot) and ``next_segment`` (ids are never
reused while a record may still name them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc

from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.journal import fsync_dir

__all__ = ["Snapshot", "read_snapshot", "write_snapshot"]

_FORMAT = b"cmx-nvme-index-1"
_SCHEMA = pa.schema(
    [
        ("key", pa.binary(32)),
        ("parent", pa.binary(32)),  # null for a first block
        ("seg", pa.uint32()),
        ("offset", pa.uint64()),
        ("length", pa.uint64()),
        ("checksum", pa.uint64()),
        ("chunk_sums", pa.binary()),
    ]
)


@dataclass(frozen=True)
class Snapshot:
    entries: list[BlockEntry]  # in index (insertion) order
    journal_gen: int
    next_segment: int


def write_snapshot(path: str, entries: Iterable[BlockEntry], journal_gen: int,
                   next_segment: int) -> None:
    rows = list(entries)
    columns = [
        pa.array([e.key for e in rows], pa.binary(32)),
        pa.array([e.parent for e in rows], pa.binary(32)),
        pa.array([e.seg for e in rows], pa.uint32()),
        pa.array([e.offset for e in rows], pa.uint64()),
        pa.array([e.length for e in rows], pa.uint64()),
        pa.array([e.checksum for e in rows], pa.uint64()),
        pa.array([e.chunk_sums for e in rows], pa.binary()),
    ]
    meta = {
        b"format": _FORMAT,
        b"journal_gen": str(journal_gen).encode(),
        b"next_segment": str(next_segment).encode(),
    }
    table = pa.Table.from_arrays(columns, schema=_SCHEMA.with_metadata(meta))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        with ipc.new_file(f, table.schema) as writer:
            writer.write_table(table)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def read_snapshot(path: str) -> Snapshot | None:
    """The snapshot at ``path``, or None if there is none. A damaged one raises ValueError."""
    try:
        with open(path, "rb") as f:
            table = ipc.open_file(f).read_all()
    except FileNotFoundError:
        return None
    except pa.ArrowException as exc:
        raise ValueError(f"index snapshot {path} is unreadable: {exc}") from exc
    meta = table.schema.metadata or {}
    if meta.get(b"format") != _FORMAT:
        raise ValueError(f"index snapshot {path} has format {meta.get(b'format')!r}")
    cols = [table.column(name).to_pylist() for name in _SCHEMA.names]
    entries = [BlockEntry(*row) for row in zip(*cols)]
    return Snapshot(entries, int(meta[b"journal_gen"]), int(meta[b"next_segment"]))
