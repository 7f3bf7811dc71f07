"""The block store interface shared by the DRAM and NVMe stores.

A store holds fixed-size blocks (at most ``block_bytes`` each) keyed by 32-byte BlockHash.

Protocol, in call order:

- ``put(key, data, parent=None)`` reserves space (evicting unpinned, committed blocks through
  the eviction policy if needed), writes and commits. The block is visible to ``get`` and
  ``in`` once ``put`` returns; a failed ``put`` leaves nothing behind. Putting a key that is
  already committed is a no-op that returns False.
- ``get(key)`` returns the block's bytes (a new buffer the caller owns) or None on a miss.
  Media that can corrupt (NVMe) verify the checksum; a mismatch is a miss and the block is
  quarantined (removed, counted in ``stats().quarantined``).
- ``pin(key)`` / ``unpin(key)``: a pinned block is never evicted or deleted. Pins nest.
  Loaders pin for the duration of a transfer; whoever pins unpins.
- ``delete(key)`` removes an unpinned block; returns whether it was there.
- ``flush()`` returns once everything put before it is durable (a no-op in DRAM).
- ``check_integrity()`` raises AssertionError with the actual numbers if the books disagree.

Every committed and removed block is reported to subscribers as a StoreEvent with a per-store
sequence number, so that a directory can follow the store and detect a gap.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

import numpy as np

from cmx.buffers import Buffer
from cmx.errors import BlockStateError
from cmx.keys import BlockHash

__all__ = ["BlockStore", "DramStats", "EventKind", "NvmeStats", "StoreEvent", "StoreStats"]


class EventKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class StoreEvent:
    seq: int  # per-store sequence number, starting at 1, no gaps
    kind: EventKind
    key: BlockHash
    size: int  # payload bytes
    checksum: int | None  # XXH3-64 where known


@dataclass
class StoreStats:
    """The figures every store has; each kind's own are the typed fields of its subclass
    (``DramStats``, ``NvmeStats``), and ``extra`` lists them by name."""

    capacity_bytes: int
    used_bytes: int  # bytes of committed and reserved blocks
    blocks: int  # committed blocks
    pinned: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    quarantined: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    @property
    def extra(self) -> dict[str, object]:
        """This kind of store's own figures by name (a report that lists them all): a copy,
        read from the typed fields."""
        common = {f.name for f in fields(StoreStats)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}


@dataclass
class DramStats(StoreStats):
    """A DRAM store's (``DramStore``): its arena's slots."""

    arena: str = ""  # the shared-memory arena's name
    slot_bytes: int = 0
    slots: int = 0
    free_slots: int = 0
    reserved: int = 0  # slots reserved for a write not yet committed or aborted
    fenced: int = 0  # slots held out of use after a reservation ended without its writer
    eviction: str = ""  # the eviction policy's name
    evict_hook_errors: int = 0  # eviction callbacks that raised


@dataclass
class NvmeStats(StoreStats):
    """An NVMe store's (``ExtentBooks``): its I/O engine, segments, journal and reads."""

    io_engine: str = ""
    direct_io: bool = False  # O_DIRECT in force on the segment files
    queue_depth: int = 0
    io_bytes: int = 0  # the engine's I/O size
    segments: int = 0
    segment_bytes: int = 0
    disk_bytes: int = 0  # blocks the segment files take on disk
    file_bytes: int = 0  # the segment files' sizes
    dead_bytes: int = 0  # of removed blocks, not yet compacted away
    compactions: int = 0
    compacted_bytes: int = 0
    journal_records: int = 0  # index records since the last snapshot
    broken_segments: int = 0
    io_size_histogram: dict[int, int] = field(default_factory=dict)  # read I/Os by size
    write_io_size_histogram: dict[int, int] = field(default_factory=dict)  # write I/Os by size
    bytes_requested: int = 0  # by readers: whole blocks or their selected runs
    bytes_read_from_disk: int = 0
    read_amplification: float = 0.0  # bytes read from disk per byte requested


class BlockStore(ABC):
    """See the module docstring for the protocol."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[StoreEvent], None]] = []
        self._seq = 0
        self._event_lock = threading.Lock()

    # -- events: the mechanism, once ----------------------------------------------------------

    def subscribe(self, callback: Callable[[StoreEvent], None]) -> None:
        """Call ``callback`` for every later event, in sequence order, on the store's thread."""
        self._subscribers.append(callback)

    @property
    def seq(self) -> int:
        """Sequence number of the last event emitted."""
        return self._seq

    def _emit(self, kind: EventKind, key: BlockHash, size: int, checksum: int | None) -> None:
        with self._event_lock:
            self._seq += 1
            event = StoreEvent(self._seq, kind, key, size, checksum)
            for callback in self._subscribers:
                callback(event)

    # -- the interface -------------------------------------------------------------------------

    @property
    @abstractmethod
    def block_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @abstractmethod
    def put(self, key: bytes, data: Buffer, parent: bytes | None = None) -> bool:
        """Store ``data`` under ``key``; False if it was already there."""

    @abstractmethod
    def get(self, key: bytes) -> np.ndarray | None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> Iterable[BlockHash]: ...

    @abstractmethod
    def pin(self, key: bytes) -> bool:
        """Pin a committed block; False on a miss."""

    @abstractmethod
    def unpin(self, key: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: bytes) -> bool: ...

    def delete_unpinned(self, keys: Iterable[bytes]) -> int:
        """``delete`` each key that is not pinned (a pinned one stays); how many went."""
        gone = 0
        for key in keys:
            try:
                gone += bool(self.delete(key))
            except BlockStateError:
                pass
        return gone

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    def flush(self) -> None:  # noqa: B027 - a no-op where writes are durable at once
        """Return once every block put before the call is durable."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
