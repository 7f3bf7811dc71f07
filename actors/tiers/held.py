"""What a memory tier holds for lookups: its books' answer, and the same in shared memory.

A lookup asks which keys are committed here and readable: not a reservation, not a block
evicted or deleted, not a copy quarantined while pinned (it is doomed: it goes at its last
unpin and nobody pins it meanwhile). ``answer`` reads the books; the ``HeldTable`` mirrors
them for readers on this host, who look keys up without a round trip to the tier. Both
change under the store's lock: the table follows the store's events (a key put when it
commits, removed when it goes) and ``doom``.
"""

from __future__ import annotations

from collections.abc import Sequence

from cmx.keys import BlockHash
from cmx.storage.base import EventKind, StoreEvent
from cmx.storage.dram import DramStore
from cmx.storage.held_table import HeldTable

__all__ = ["HeldKeys"]


class HeldKeys:
    def __init__(self, store: DramStore, table_name: str) -> None:
        self.store = store
        self.doomed: set[BlockHash] = set()  # quarantined while pinned: dropped at last unpin
        self.table = HeldTable.create(table_name, store.arena.num_slots)
        store.subscribe(self._on_event)

    def doom(self, key: BlockHash) -> None:
        """``key``'s copy goes at its last unpin; from now on no lookup finds it. Under the
        store's lock (an RLock), as every write of the table: it has one writer at a time."""
        with self.store._lock:
            self.doomed.add(key)
            self.table.remove(key)

    def answer(self, keys: Sequence[BlockHash]) -> list[tuple[int, int] | None]:
        """Per key, (size, checksum) of its copy if one is committed here and readable, else
        None. Nothing is pinned, no hit is counted and eviction order is untouched: a lookup
        is not a use. One snapshot under the store's lock."""
        books = self.store
        with books._lock:
            if books.closed:
                return [None] * len(keys)
            out: list[tuple[int, int] | None] = []
            for key in keys:
                entry = books._index.get(key)
                if entry is None or not entry.committed or key in self.doomed:
                    out.append(None)
                else:
                    out.append((entry.size, entry.checksum or 0))
            return out

    def check_integrity(self) -> None:
        """The table holds exactly the keys the books answer for, with their sizes."""
        books = self.store
        with books._lock:
            if books.closed:
                return
            keys = [k for k, e in books._index.items() if e.committed]
            if len(self.table) != sum(k not in self.doomed for k in keys):
                raise AssertionError(f"the held table has {len(self.table)} keys, the books "
                                     f"{len(keys) - len(self.doomed)} readable")
            mirrored = self.table.find(keys) if keys else []
            if mirrored is None:
                raise AssertionError("the held table is closed while its tier is open")
            for key, got, want in zip(keys, mirrored, self.answer(keys)):
                if (got and got[0]) != (want and want[0]):
                    raise AssertionError(f"{key.hex()[:12]}: the held table says {got}, "
                                         f"the books {want}")

    def close(self) -> None:
        self.table.unlink()

    def _on_event(self, event: StoreEvent) -> None:
        if event.kind is EventKind.STORED:
            if event.key not in self.doomed:
                self.table.put(event.key, event.size, event.checksum or 0)
        elif event.kind is EventKind.REMOVED:
            self.table.remove(event.key)
            self.doomed.discard(event.key)
