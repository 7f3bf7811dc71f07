"""Control plane of a node's NVMe tier: the log's space, index, journal and eviction.

The tier hands out extents and records commits; the offload agent writes and reads the
bytes (``actors.nvme_io``). Protocol, in call order:

1. ``reserve([(key, parent, size)])`` -> an Extent per key (None if already stored or no
   room). Space is held until commit or abort.
2. The agent writes the extent, then ``commit([(key, size, checksum, chunk_sums)])``; the
   segment data is made durable and the index record journaled before the block is visible.
3. Readers ``pin(keys)`` -> Extents (None on a miss), read and verify, then ``unpin``.
   A reader that finds a bad checksum calls ``quarantine(keys)``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

from cmx.actors.directory import Entry, Source
from cmx.actors.events import EventPublisher
from cmx.actors.nvme_io import Extent
from cmx.errors import BlockStateError
from cmx.keys import BlockHash
from cmx.storage.nvme.extents import ExtentStore, PendingExtent
from cmx.tiers import Tier

__all__ = ["NvmeTierService", "extent_holdings"]

STALE_WRITE_S = 120.0  # a reserved extent not committed by then belongs to a dead writer


class NvmeTierService:
    def __init__(
        self,
        node: str,
        root: str,
        capacity_bytes: int,
        block_bytes: int,
        directory: object,
        num_shards: int,
        eviction: str = "lru",
        segment_bytes: int = 256 << 20,
    ) -> None:
        self.tier = Tier.NVME
        self.node = node
        self.epoch = uuid.uuid4().hex[:8]
        self.store = ExtentStore(
            root, capacity_bytes=capacity_bytes, block_bytes=block_bytes, eviction=eviction,
            segment_bytes=segment_bytes,
        )
        self._pending: dict[BlockHash, PendingExtent] = {}
        self._lock = threading.Lock()
        self.publisher = EventPublisher(
            Source(node, Tier.NVME),
            self.epoch,
            num_shards,
            lambda shard, method, *args: directory.call(  # type: ignore[attr-defined]
                f"cmx:dir:{shard}", method, *args
            ),
            self._holdings,
            self.store.event_lock,
        )
        self.store.subscribe(self.publisher.on_event)

    def info(self) -> dict[str, object]:
        return {"tier": self.tier.value, "node": self.node, "epoch": self.epoch,
                "root": self.store.root}

    def reserve(
        self, items: Sequence[tuple[BlockHash, BlockHash | None, int]]
    ) -> list[Extent | None]:
        out: list[Extent | None] = []
        for key, parent, size in items:
            pending = self.store.reserve_extent(key, parent, size)
            if pending is None:
                out.append(None)
                continue
            with self._lock:
                self._pending[key] = pending
            out.append(Extent(key, pending.path, pending.offset, size))
        return out

    def commit(self, items: Sequence[tuple[BlockHash, int, int, bytes]]) -> int:
        done = 0
        for key, size, csum, chunk_sums in items:
            with self._lock:
                pending = self._pending.pop(key, None)
            if pending is not None and pending.size == size:
                self.store.commit_extent(pending, csum, chunk_sums)
                done += 1
            elif pending is not None:
                self.store.abort_extent(pending)
        self.store.flush()  # durable before it is announced
        self.publisher.flush()
        return done

    def abort(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            with self._lock:
                pending = self._pending.pop(key, None)
            if pending is not None:
                self.store.abort_extent(pending)

    def pin(self, keys: Sequence[BlockHash]) -> list[Extent | None]:
        out: list[Extent | None] = []
        for key in keys:
            if not self.store.pin(key):
                out.append(None)
                continue
            entry = self.store.entry_of(key)
            if entry is None:
                self.store.unpin(key)
                out.append(None)
                continue
            out.append(Extent(key, self.store.segment_path(entry.seg), entry.offset,
                              entry.length, entry.checksum))
        return out

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            try:
                self.store.unpin(key)
            except BlockStateError:
                pass

    def quarantine(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            self.store.quarantine(key)
        self.publisher.flush()

    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [key in self.store for key in keys]

    def evict(self, keys: Sequence[BlockHash]) -> int:
        gone = self.store.delete_unpinned(keys)
        self.publisher.flush()
        return gone

    def heartbeat(self) -> bool:
        """Resync the directory; give back space held by writes that never finished."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, p in self._pending.items() if now - p.since > STALE_WRITE_S]
        self.abort(stale)
        return self.publisher.flush(heartbeat=True)

    def stats(self) -> dict[str, object]:
        s = self.store.stats()
        return {
            "tier": self.tier.value,
            "node": self.node,
            "emulated": False,
            "epoch": self.epoch,
            "capacity_bytes": s.capacity_bytes,
            "used_bytes": s.used_bytes,
            "blocks": s.blocks,
            "pinned": s.pinned,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "quarantined": s.quarantined,
            "bytes_in": s.bytes_written,
            "bytes_out": s.bytes_read,
            "directory_failures": self.publisher.failures,
            "directory_resyncs": self.publisher.resyncs,
            **{k: v for k, v in s.extra.items() if k in ("segments", "dead_bytes", "io_engine")},
        }

    def check_integrity(self) -> None:
        self.store.check_integrity()

    def close(self) -> None:
        self.store.close()

    def _holdings(self) -> list[Entry]:
        return extent_holdings(self.store)


def extent_holdings(store: ExtentStore) -> list[Entry]:
    """Every committed block of an NVMe store as a directory entry, for a resync."""
    entries = []
    for key in store.keys():
        entry = store.entry_of(key)
        if entry is not None:
            entries.append(Entry(key, True, entry.length, entry.checksum))
    return entries
