"""LRU: the least recently stored or hit block goes first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

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

    def _on_remove(self, key: Key) -> None:
        self._recency.pop(key, None)

    def _order(self) -> Iterator[Key]:
        return iter(list(self._recency))

    def _check_policy(self) -> None:
        if len(self._recency) != len(self._parent):
            raise AssertionError(
                f"lru holds {len(self._recency)} keys, resident {len(self._parent)}"
            )
