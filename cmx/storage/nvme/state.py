"""NvmeState: the attributes and internal calls the parts of NvmeStore share.

NvmeStore is assembled from parts, one per concern (core, books, space, slices, store); each
part is a class over this state. ``NvmeCore.__init__`` sets every attribute listed here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import numpy as np

from cmx.policies import EvictionPolicy
from cmx.storage.base import BlockStore
from cmx.storage.nvme.entry import BlockEntry
from cmx.storage.nvme.files import FileOps
from cmx.storage.nvme.io import IoEngine
from cmx.storage.nvme.journal import Journal
from cmx.storage.nvme.records import RecordDel
from cmx.storage.nvme.segments import Segment, SegmentSet
from cmx.storage.nvme.staging import Staging

__all__ = ["NvmeState"]


class NvmeState(BlockStore):
    root: str
    _capacity: int  # bytes of extents, dead space included
    _block_bytes: int
    _compact_threshold: int  # dead bytes above which compaction runs before eviction
    _snapshot_every: int  # journal records after which a flush snapshots instead
    _lock: threading.RLock  # the books
    _idle: threading.Condition  # on _lock: no operation in progress
    _space_lock: threading.Lock  # one writer makes room at a time
    _flush_lock: threading.Lock  # one flush or snapshot at a time
    _index: dict[bytes, BlockEntry]  # committed blocks, least recently inserted first
    _pins: dict[bytes, int]
    _reserving: set[bytes]  # keys whose put is writing
    _pending: list[BlockEntry | RecordDel]  # records for the next flush
    _next_seq: int  # the sequence number of the next record
    _files: FileOps
    _counts: dict[str, int]
    _policy: EvictionPolicy
    _engine: IoEngine
    _wstage: Staging
    _rstage: Staging
    _segs: SegmentSet
    _journal: Journal

    if TYPE_CHECKING:  # provided by the parts; declared here for the type checker only

        def _op(self) -> AbstractContextManager[None]: ...
        def _flush(self) -> None: ...
        def _reserve(self, key: bytes, ext: int) -> tuple[Segment, int] | None: ...
        def _finish_put(self, key: bytes, seg: Segment, ext: int,
                        entry: BlockEntry | None) -> None: ...
        def _lookup(self, key: bytes,
                    min_room: int | None = None) -> tuple[BlockEntry, Segment] | None: ...
        def _lookup_runs(self, reqs: Sequence[tuple[bytes, int, int]]
                         ) -> tuple[list[BlockEntry | None], dict[int, Segment]]: ...
        def _release(self, seg: Segment) -> None: ...
        def _verified(self, entry: BlockEntry, payload: np.ndarray) -> bool: ...
        def _quarantine(self, entry: BlockEntry) -> None: ...
        def _remove(self, entry: BlockEntry) -> None: ...
        def _count_runs(self, entries: list[BlockEntry | None], bad: set[bytes],
                        requested: int, read: int) -> None: ...
        @staticmethod
        def _sums(view: np.ndarray) -> tuple[int, bytes]: ...
