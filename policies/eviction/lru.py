"""LRU: the least recently stored or hit block goes first."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from itertools import islice

from cmx.policies.eviction.base import EvictionPolicy, Key

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._recency: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def _on_insert(self, key: Key) -> None:
        self._recency[key] = None

    def _on_touch(self, key: Key) -> None:
        self._recency.move_to_end(key)

    def _on_touch_many(self, keys: list[Key]) -> None:
        # A reader's prefix of 62,500 blocks moved in one C loop, not one Python call a key.
        deque(map(self._recency.move_to_end, keys), maxlen=0)

    def _on_remove(self, key: Key) -> None:
        self._recency.pop(key, None)

    def _order(self) -> Iterator[Key]:
        # Oldest first, read in growing chunks rather than copied whole: a store wants a victim
        # or a few, and the caller may evict (or touch) keys between two of them. A key
        # touched meanwhile has moved to the end and is not given twice.
        given: set[Key] = set()
        size = 32
        while True:
            chunk = list(islice(self._recency, size))
            for key in chunk:
                if key not in given:
                    given.add(key)
                    yield key
            if len(chunk) < size:
                return
            size *= 4

    def _check_policy(self) -> None:
        if len(self._recency) != len(self._parent):
            raise AssertionError(
                f"lru holds {len(self._recency)} keys, resident {len(self._parent)}"
            )
