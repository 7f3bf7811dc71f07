"""The eviction policy interface. The base class owns the mechanism; a policy fills one hook.

Protocol, in call order (the store calls these, under its own lock):

1. ``insert(key, parent)`` when a block is committed. ``parent`` is the key of the previous
   block of the same prefix, or None for a first block.
2. ``touch(key)`` on every hit (``touch_many(keys)`` for a reader's whole prefix, in order).
3. ``victims(can_evict)`` when space is needed: yields keys, best victim first. The store calls
   ``can_evict`` itself (pinned and uncommitted blocks are skipped) and stops iterating once it
   has room, then calls ``remove`` for each block it actually evicted.
4. ``remove(key)`` whenever a block leaves the store (evicted, deleted, quarantined).

Prefix awareness lives here, once: a block whose parent has left is worth nothing (no lookup
can reach it), so orphans go first; then leaves (blocks no resident block builds on) in the
policy's order; interior blocks last. A policy only orders keys: ``_order()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

__all__ = ["EvictionPolicy"]

Key = bytes
__all__ += ["Key"]


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        self._parent: dict[Key, Key | None] = {}  # resident key -> its parent key
        self._kids: dict[Key, set[Key]] = {}  # any key -> its resident children
        self._orphans: dict[Key, None] = {}  # resident keys whose parent is not resident

    # -- the mechanism -------------------------------------------------------------------------

    def insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._parent:
            self.touch(key)
            return
        self._parent[key] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(key)
            if parent not in self._parent:
                self._orphans[key] = None
        for child in self._kids.get(key, ()):  # children stored before their parent
            self._orphans.pop(child, None)
        self._on_insert(key)

    def touch(self, key: Key) -> None:
        if key in self._parent:
            self._on_touch(key)

    def touch_many(self, keys: Sequence[Key]) -> None:
        """``touch`` each key, in order; a policy may do it in one pass (``_on_touch_many``)."""
        resident = self._parent
        self._on_touch_many([key for key in keys if key in resident])

    def remove(self, key: Key) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        self._orphans.pop(key, None)
        if parent is not None:
            siblings = self._kids[parent]
            siblings.discard(key)
            if not siblings:
                del self._kids[parent]
        for child in self._kids.get(key, ()):
            self._orphans[child] = None
        self._on_remove(key)

    def _on_touch_many(self, keys: list[Key]) -> None:
        for key in keys:
            self._on_touch(key)

    def victims(self, can_evict: Callable[[Key], bool]) -> Iterator[Key]:
        """Candidates best-first: orphans, then leaves in policy order, then everything else."""
        for key in list(self._orphans):
            if key in self._parent and can_evict(key):
                yield key
        deferred: list[Key] = []
        for key in self._order():
            if key not in self._parent or key in self._orphans:
                continue
            if self._kids.get(key):
                deferred.append(key)
            elif can_evict(key):
                yield key
        for key in deferred:
            if key in self._parent and can_evict(key):
                yield key

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if the prefix bookkeeping is inconsistent."""
        kids: dict[Key, set[Key]] = {}
        for key, parent in self._parent.items():
            if parent is not None:
                kids.setdefault(parent, set()).add(key)
            is_orphan = parent is not None and parent not in self._parent
            if is_orphan != (key in self._orphans):
                raise AssertionError(
                    f"{key.hex()[:12]}: orphan={is_orphan} but listed={not is_orphan}"
                )
        if kids != self._kids:
            raise AssertionError(
                f"children index has {len(self._kids)} parents, actual {len(kids)}"
            )
        if len(self._orphans) > len(self._parent):
            raise AssertionError(f"orphans {len(self._orphans)} > resident {len(self._parent)}")
        self._check_policy()

    # -- the hooks a policy fills --------------------------------------------------------------

    @abstractmethod
    def _on_insert(self, key: Key) -> None: ...

    @abstractmethod
    def _on_touch(self, key: Key) -> None: ...

    @abstractmethod
    def _on_remove(self, key: Key) -> None: ...

    @abstractmethod
    def _order(self) -> Iterator[Key]:
        """Resident keys in eviction order, best victim first. May reorganize lazily."""

    def _check_policy(self) -> None:  # noqa: B027 - optional hook
        """Policy-specific invariants; raise AssertionError with the numbers."""
