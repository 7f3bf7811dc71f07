"""Random put/delete/pin/unpin/get/flush/reopen sequences keep the books and the bytes right."""

from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvme_helpers import BLOCK, key, open_store, payload

from cmx.errors import BlockStateError, StoreFullError
from cmx.storage.base import EventKind

KEYS = 12
SIZE = {i: [1, 9000, 130_000, BLOCK - 4096, BLOCK][i % 5] for i in range(KEYS)}

# Puts weigh most, so sequences fill the store and exercise eviction and compaction.
NAMES = ["put"] * 5 + ["delete", "pin", "unpin", "get", "flush", "reopen"]
ops = st.lists(
    st.tuples(st.sampled_from(NAMES), st.integers(0, KEYS - 1), st.integers(-1, KEYS - 1)),
    min_size=10,
    max_size=80,
)


class Model:
    """What the store must hold, told by its own events; pins are the test's own."""

    def __init__(self) -> None:
        self.present: set[bytes] = set()
        self.pins: dict[bytes, int] = {}

    def on_event(self, event) -> None:
        if event.kind is EventKind.STORED:
            assert event.key not in self.present
            self.present.add(event.key)
        else:
            assert event.key in self.present
            assert not self.pins.get(event.key), "a pinned block left the store"
            self.present.discard(event.key)


def check(store, model: Model) -> None:
    store.check_integrity()
    assert set(store.keys()) == model.present
    for i in range(KEYS):
        k = key(i)
        if k in model.present:
            np.testing.assert_array_equal(store.get(k), payload(k, SIZE[i]))
    stats = store.stats()
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.extra["file_bytes"] <= stats.capacity_bytes + stats.extra["segment_bytes"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([BLOCK, 2 * BLOCK]))
def test_random_operations_keep_every_invariant(sequence, segment_bytes):
    opts = dict(capacity_bytes=3 * BLOCK, segment_bytes=segment_bytes,
                compact_threshold_bytes=BLOCK)
    with tempfile.TemporaryDirectory(dir=None) as root:
        model = Model()
        store = open_store(root, **opts)
        store.subscribe(model.on_event)
        for name, i, parent_i in sequence:
            k = key(i)
            if name == "put":
                parent = key(parent_i) if parent_i >= 0 else None
                was_present = k in model.present
                try:
                    stored = store.put(k, payload(k, SIZE[i]), parent=parent)
                except StoreFullError:
                    assert model.pins, "full although nothing is pinned"
                    continue
                assert stored == (not was_present)
                assert k in model.present
            elif name == "delete":
                if model.pins.get(k):
                    try:
                        store.delete(k)
                        raise AssertionError("deleted a pinned block")
                    except BlockStateError:
                        pass
                else:
                    was_present = k in model.present
                    assert store.delete(k) == was_present
            elif name == "pin":
                if store.pin(k):
                    model.pins[k] = model.pins.get(k, 0) + 1
            elif name == "unpin":
                if model.pins.get(k):
                    store.unpin(k)
                    model.pins[k] -= 1
                else:
                    try:
                        store.unpin(k)
                        raise AssertionError("unpinned a block that was not pinned")
                    except BlockStateError:
                        pass
            elif name == "get":
                got = store.get(k)
                if k in model.present:
                    np.testing.assert_array_equal(got, payload(k, SIZE[i]))
                else:
                    assert got is None
            elif name == "flush":
                store.flush()
            else:  # reopen: close() flushes, so everything must come back; pins do not persist
                store.close()
                store = open_store(root, **opts)
                model.pins.clear()
                store.subscribe(model.on_event)
            check(store, model)
        store.close()
