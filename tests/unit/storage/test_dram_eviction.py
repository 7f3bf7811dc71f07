"""DramStore pins and eviction: LRU and S3-FIFO order, pins, reservations, the eviction hook."""

from __future__ import annotations

import numpy as np
import pytest
from dram_helpers import MakeStore, key, payload, snapshot

from cmx.errors import BlockStateError, StoreFullError
from cmx.storage.blocks import BlockMeta
from cmx.storage.dram import DramStore

# -- pins and eviction ------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used(make_store: MakeStore) -> None:
    store = make_store(slots=3)
    for i in range(3):
        store.put(key(i), payload(i))
    store.get(key(0))
    store.put(key(3), payload(3))
    assert sorted(store.keys()) == [key(0), key(2), key(3)]
    assert store.stats().evictions == 1
    store.check_integrity()


def test_pins_nest_and_block_eviction_and_delete(make_store: MakeStore) -> None:
    store = make_store(slots=2)
    store.put(key(0), payload(0))
    store.put(key(1), payload(1))
    assert store.pin(key(0)) and store.pin(key(0))
    store.unpin(key(0))
    store.put(key(2), payload(2))  # 0 is still pinned once: 1 goes
    assert sorted(store.keys()) == [key(0), key(2)]
    with pytest.raises(BlockStateError):
        store.delete(key(0))
    assert store.stats().pinned == 1
    store.unpin(key(0))
    with pytest.raises(BlockStateError):
        store.unpin(key(0))
    assert store.delete(key(0)) is True and store.delete(key(0)) is False
    store.check_integrity()


def test_store_full_when_every_block_is_pinned(make_store: MakeStore) -> None:
    store = make_store(slots=3)
    for i in range(3):
        store.put(key(i), payload(i))
        store.pin(key(i))
    before = snapshot(store)
    with pytest.raises(StoreFullError, match="3 blocks pinned"):
        store.put(key(9), payload(9))
    with pytest.raises(StoreFullError):
        store.reserve(key(9))
    assert snapshot(store) == before
    store.unpin(key(1))
    store.put(key(9), payload(9))
    assert key(1) not in store and key(9) in store
    store.check_integrity()


def test_reserved_blocks_are_never_evicted(make_store: MakeStore) -> None:
    store = make_store(slots=2)
    res = store.reserve(key(0))
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))  # evicts 1, not the reservation
    assert store.keys() == [key(2)]
    store.pin(key(2))
    with pytest.raises(StoreFullError, match="1 reserved"):
        store.put(key(3), payload(3))
    store.commit(res)
    store.unpin(key(2))
    store.check_integrity()


def test_s3fifo_store_keeps_reused_blocks_through_a_scan(make_store: MakeStore) -> None:
    store = make_store(slots=8, block_bytes=100, eviction="s3fifo")
    for i in range(3):
        store.put(key(i), payload(i, 100))
        store.get(key(i))
    for i in range(100, 140):  # a scan of one-hit wonders
        store.put(key(i), payload(i, 100))
    assert all(key(i) in store for i in range(3))
    store.check_integrity()


def test_eviction_is_prefix_aware(make_store: MakeStore) -> None:
    store = make_store(slots=4)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2), parent=key(1))
    store.put(key(3), payload(3), parent=key(2))
    store.put(key(9), payload(9))
    store.get(key(9))  # 9 is the most recent, yet the only other leaf (3) is older
    store.put(key(4), payload(4))
    assert key(3) not in store  # the leaf goes before its older ancestors
    store.delete(key(4))
    store.delete(key(1))  # 2 is now an orphan: no lookup can reach it
    store.put(key(5), payload(5))
    store.put(key(6), payload(6))
    assert len(store) == 4
    store.put(key(7), payload(7))  # the orphan goes first, though 9 is older than 5 and 6
    assert key(2) not in store and all(key(i) in store for i in (5, 6, 7, 9))
    store.check_integrity()


# -- the eviction hook ------------------------------------------------------------------------


def test_on_evict_sees_the_evicted_bytes(make_store: MakeStore) -> None:
    demoted: dict[bytes, tuple[bytes, BlockMeta]] = {}

    def demote(k: bytes, view: np.ndarray, meta: BlockMeta) -> None:
        assert not view.flags.writeable
        demoted[k] = (view.tobytes(), meta)

    store = make_store(slots=2, on_evict=demote)
    store.put(key(1), payload(1, 1234), checksum=7)
    store.put(key(2), payload(2), parent=key(1))
    store.put(key(3), payload(3))  # evicts 2, the leaf
    assert list(demoted) == [key(2)]
    assert demoted[key(2)] == (payload(2).tobytes(), BlockMeta(5000, None, key(1)))
    store.put(key(4), payload(4))  # evicts 1, now the oldest leaf
    assert demoted[key(1)] == (payload(1, 1234).tobytes(), BlockMeta(1234, 7, None))
    assert store.delete(key(3)) and key(3) not in demoted  # a delete is not an eviction
    store.check_integrity()


def test_a_failing_hook_drops_the_block_and_is_counted(make_store: MakeStore) -> None:
    def broken(k: bytes, view: np.ndarray, meta: BlockMeta) -> None:
        raise OSError("disk full")

    store = make_store(slots=1, on_evict=broken)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))
    assert store.keys() == [key(2)]
    assert store.stats().extra["evict_hook_errors"] == 1
    store.check_integrity()


def test_the_hook_may_read_the_store_and_its_block_stays_put(make_store: MakeStore) -> None:
    store: DramStore

    def reentrant(k: bytes, view: np.ndarray, meta: BlockMeta) -> None:
        assert k in store
        with pytest.raises(BlockStateError):
            store.delete(k)  # pinned while the hook runs
        store.get(key(2))

    store = make_store(slots=2, on_evict=reentrant)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))
    store.put(key(3), payload(3))
    assert sorted(store.keys()) == [key(2), key(3)]
    assert store.stats().extra["evict_hook_errors"] == 0
    store.check_integrity()
