"""DramStore against a dict model: random reserve/commit/abort/put/delete/pin/unpin/get runs.

The model mirrors the store's eviction policy with a second instance fed the same calls, so
every eviction must pick exactly the victim the policy names, and only an unpinned, committed
block. ``check_integrity()`` runs after every step.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cmx.errors import BlockStateError, StoreFullError
from cmx.policies import make_eviction
from cmx.storage.base import EventKind, StoreEvent
from cmx.storage.blocks import Reservation
from cmx.storage.dram import DramStore

SLOTS = 4
BLOCK = 3000
KEYS = [i.to_bytes(32, "little") for i in range(8)]

keys = st.sampled_from(KEYS)
parents = st.none() | st.sampled_from(KEYS)
sizes = st.integers(0, BLOCK)


def data_of(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class DramMachine(RuleBasedStateMachine):
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.store = DramStore(capacity_bytes=SLOTS * 4096, block_bytes=BLOCK,
                               eviction=self.eviction)
        self.events: list[StoreEvent] = []
        self.store.subscribe(self.events.append)
        self.seen_events = 0
        self.ref = make_eviction(self.eviction)  # fed the same calls as the store's policy
        self.committed: dict[bytes, bytes] = {}
        self.reserved: dict[bytes, tuple[Reservation, bytes]] = {}
        self.pins: Counter[bytes] = Counter()
        self.closed: list[Reservation] = []  # committed or aborted: must stay closed

    def teardown(self) -> None:
        self.store.close()

    # -- model helpers --------------------------------------------------------------------------

    def _full(self) -> bool:
        free = SLOTS - len(self.committed) - len(self.reserved)
        return free == 0 and all(self.pins[k] for k in self.committed)

    def _eviction(self) -> list[tuple[EventKind, bytes]]:
        """Before a reserve: if no slot is free, the policy's first victim must leave."""
        if len(self.committed) + len(self.reserved) < SLOTS:
            return []
        victim = next(self.ref.victims(lambda k: k in self.committed and not self.pins[k]))
        self.ref.remove(victim)
        del self.committed[victim]
        return [(EventKind.REMOVED, victim)]

    def _expect_events(self, *expected: tuple[EventKind, bytes]) -> None:
        new = self.events[self.seen_events :]
        self.seen_events = len(self.events)
        assert [(e.kind, e.key) for e in new] == list(expected)

    def _parent(self, key: bytes, parent: bytes | None) -> bytes | None:
        return None if parent == key else parent

    # -- rules --------------------------------------------------------------------------------

    @rule(key=keys, parent=parents, size=sizes, seed=st.integers(0, 99))
    def reserve(self, key: bytes, parent: bytes | None, size: int, seed: int) -> None:
        parent = self._parent(key, parent)
        if key in self.committed or key in self.reserved:
            try:
                self.store.reserve(key, parent)
                raise AssertionError("reserve of a held key succeeded")
            except BlockStateError:
                return
        if self._full():
            try:
                self.store.reserve(key, parent)
                raise AssertionError("reserve succeeded with every block pinned or reserved")
            except StoreFullError:
                return
        evicted = self._eviction()
        res = self.store.reserve(key, parent)
        data = data_of(seed, size)
        res.buffer[:size] = np.frombuffer(data, np.uint8)
        self.reserved[key] = (res, data)
        self._expect_events(*evicted)

    @precondition(lambda self: self.reserved)
    @rule(pick=st.integers(0, SLOTS))
    def commit(self, pick: int) -> None:
        key = sorted(self.reserved)[pick % len(self.reserved)]
        res, data = self.reserved.pop(key)
        self.store.commit(res, size=len(data))
        self.committed[key] = data
        self.ref.insert(key, res.parent)
        self.closed.append(res)
        self._expect_events((EventKind.STORED, key))

    @precondition(lambda self: self.reserved)
    @rule(pick=st.integers(0, SLOTS))
    def abort(self, pick: int) -> None:
        key = sorted(self.reserved)[pick % len(self.reserved)]
        res, _ = self.reserved.pop(key)
        self.store.abort(res)
        self.closed.append(res)
        self._expect_events()

    @precondition(lambda self: self.closed)
    @rule(pick=st.integers(0, 50), commit=st.booleans())
    def reuse_closed_reservation(self, pick: int, commit: bool) -> None:
        res = self.closed[pick % len(self.closed)]
        try:
            self.store.commit(res) if commit else self.store.abort(res)
            raise AssertionError("a closed reservation was used again")
        except BlockStateError:
            pass

    @rule(key=keys, parent=parents, size=sizes, seed=st.integers(0, 99))
    def put(self, key: bytes, parent: bytes | None, size: int, seed: int) -> None:
        parent = self._parent(key, parent)
        data = data_of(seed, size)
        if key in self.committed or key in self.reserved:
            assert self.store.put(key, data, parent) is False
            return
        if self._full():
            try:
                self.store.put(key, data, parent)
                raise AssertionError("put succeeded with every block pinned or reserved")
            except StoreFullError:
                return
        evicted = self._eviction()
        assert self.store.put(key, data, parent) is True
        self.committed[key] = data
        self.ref.insert(key, parent)
        self._expect_events(*evicted, (EventKind.STORED, key))

    @rule(key=keys)
    def get(self, key: bytes) -> None:
        got = self.store.get(key)
        if key in self.committed:
            assert got is not None and got.tobytes() == self.committed[key]
            self.ref.touch(key)
        else:
            assert got is None

    @rule(key=keys)
    def pin(self, key: bytes) -> None:
        assert self.store.pin(key) is (key in self.committed)
        if key in self.committed:
            self.pins[key] += 1
            self.ref.touch(key)

    @rule(key=keys)
    def unpin(self, key: bytes) -> None:
        if self.pins[key]:
            self.store.unpin(key)
            self.pins[key] -= 1
        else:
            try:
                self.store.unpin(key)
                raise AssertionError("unpin of an unpinned block succeeded")
            except BlockStateError:
                pass

    @rule(key=keys)
    def delete(self, key: bytes) -> None:
        if key in self.committed and self.pins[key]:
            try:
                self.store.delete(key)
                raise AssertionError("delete of a pinned block succeeded")
            except BlockStateError:
                return
        assert self.store.delete(key) is (key in self.committed)
        if key in self.committed:
            del self.committed[key]
            self.ref.remove(key)
            self._expect_events((EventKind.REMOVED, key))

    # -- after every step ---------------------------------------------------------------------

    @invariant()
    def books_agree(self) -> None:
        self.store.check_integrity()
        self.ref.check_integrity()
        assert sorted(self.store.keys()) == sorted(self.committed)
        assert len(self.store) == len(self.committed)
        stats = self.store.stats()
        assert stats.pinned == sum(1 for n in self.pins.values() if n)
        assert stats.extra["reserved"] == len(self.reserved)
        assert stats.extra["free_slots"] == SLOTS - len(self.committed) - len(self.reserved)
        assert stats.used_bytes == (sum(map(len, self.committed.values()))
                                    + BLOCK * len(self.reserved))
        assert [e.seq for e in self.events] == list(range(1, len(self.events) + 1))


class LRUDramMachine(DramMachine):
    eviction = "lru"


class S3FIFODramMachine(DramMachine):
    eviction = "s3fifo"


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestDramStoreLRU = LRUDramMachine.TestCase
TestDramStoreLRU.settings = _settings
TestDramStoreS3FIFO = S3FIFODramMachine.TestCase
TestDramStoreS3FIFO.settings = _settings
