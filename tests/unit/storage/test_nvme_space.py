"""Capacity, eviction through the policy, pins, and compaction of dead space."""

from __future__ import annotations

import numpy as np
import pytest
from nvme_helpers import BLOCK, disk_bytes, key, open_store, payload, segment_files

from cmx.errors import StoreFullError
from cmx.storage.base import EventKind
from cmx.storage.nvme.chunks import extent_bytes


def one_block_segments(tmp_path, blocks: int, **kwargs):
    """Each block in its own segment: eviction frees exactly one block's space."""
    return open_store(tmp_path, capacity_bytes=blocks * BLOCK, segment_bytes=BLOCK, **kwargs)


def removed(events):
    return [e.key for e in events if e.kind is EventKind.REMOVED]


def test_lru_evicts_the_least_recently_used_block(tmp_path):
    store = one_block_segments(tmp_path, 4)
    events = []
    store.subscribe(events.append)
    for i in range(4):
        store.put(key(i), payload(key(i), BLOCK))
    store.get(key(0))  # key 0 is now the most recent; key 1 the least
    store.put(key(4), payload(key(4), BLOCK))
    assert removed(events) == [key(1)]
    store.put(key(5), payload(key(5), BLOCK))
    assert removed(events) == [key(1), key(2)]
    stats = store.stats()
    assert stats.evictions == 2 and stats.blocks == 4 and stats.used_bytes == 4 * BLOCK
    for i in (0, 3, 4, 5):
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), BLOCK))
    store.check_integrity()
    store.close()


def test_orphans_go_first(tmp_path):
    store = one_block_segments(tmp_path, 4)
    events = []
    store.subscribe(events.append)
    block = np.zeros(BLOCK, np.uint8)
    store.put(key(0), block)
    store.put(key(1), block, parent=key(0))
    store.put(key(2), block, parent=key(1))
    store.put(key(3), block, parent=key(99))  # its parent is not here: an orphan
    store.put(key(4), block)
    assert removed(events) == [key(3)]  # the newest, but no lookup can reach it
    store.put(key(5), block)
    assert removed(events) == [key(3), key(2)]  # then a leaf, never the chain's root first
    store.check_integrity()
    store.close()
    store = one_block_segments(tmp_path, 4)  # parents survive a reopen
    events = []
    store.subscribe(events.append)
    store.get(key(1))  # key 1 is now the most recently used
    store.delete(key(0))
    store.put(key(6), block)  # fits where key 0 was
    store.put(key(7), block)
    assert removed(events) == [key(0), key(1)]  # key 1 became an orphan: it goes first
    store.close()


def test_pinned_blocks_are_never_evicted(tmp_path):
    store = one_block_segments(tmp_path, 3)
    for i in range(3):
        store.put(key(i), payload(key(i), BLOCK))
        store.pin(key(i))
    store.unpin(key(1))
    store.put(key(3), payload(key(3), BLOCK))
    assert key(1) not in store and all(key(i) in store for i in (0, 2, 3))
    store.pin(key(3))
    before = (store.stats(), segment_files(tmp_path))
    with pytest.raises(StoreFullError):
        store.put(key(4), payload(key(4), BLOCK))
    assert (store.stats(), segment_files(tmp_path)) == before
    store.unpin(key(0))
    store.put(key(4), payload(key(4), BLOCK))
    assert key(0) not in store
    store.check_integrity()
    store.close()


def test_disk_never_exceeds_capacity_plus_one_segment(tmp_path):
    cap, seg = 8 * BLOCK, 2 * BLOCK
    store = open_store(tmp_path, capacity_bytes=cap, segment_bytes=seg,
                       compact_threshold_bytes=BLOCK)
    rng = np.random.default_rng(0)
    live = {}
    for i in range(120):
        k = key(i)
        n = int(rng.integers(1, BLOCK))
        store.put(k, payload(k, n))
        live[k] = n
        if i % 3 == 0:  # hits keep old blocks alive in old segments: dead space scatters
            for old in list(live)[-int(rng.integers(1, 8)):]:
                store.get(old)
        if i % 7 == 0 and len(store):
            store.delete(next(iter(store.keys())))
        assert disk_bytes(tmp_path) <= cap + seg
        assert store.stats().used_bytes <= cap
    assert store.stats().extra["compactions"] > 0
    for k in store.keys():
        np.testing.assert_array_equal(store.get(k), payload(k, live[k]))
    store.check_integrity()
    store.close()


def test_appends_go_into_space_allocated_ahead(tmp_path):
    ext = extent_bytes(BLOCK)
    seg = 4 * ext
    store = open_store(tmp_path, capacity_bytes=8 * ext, segment_bytes=seg)
    assert store.stats().extra["direct_io"]  # the test directory is on a disk filesystem
    store.put(key(0), payload(key(0), BLOCK))
    # The whole active segment is allocated at once: later appends overwrite, never extend.
    assert disk_bytes(tmp_path) == seg == store.stats().extra["file_bytes"]
    for i in range(1, 6):
        store.put(key(i), payload(key(i), BLOCK))
    assert segment_files(tmp_path) == ["seg-000001.dat", "seg-000002.dat"]
    assert disk_bytes(tmp_path) == 2 * seg
    store.check_integrity()
    store.close()
    store = open_store(tmp_path, capacity_bytes=8 * ext, segment_bytes=seg)
    # The full sealed segment, and the second cut to its head: a reopened segment takes no
    # more appends (a write granted before may still land past its head).
    assert disk_bytes(tmp_path) == seg + 2 * ext
    for i in range(6):
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), BLOCK))
    store.check_integrity()
    store.close()


def test_compaction_reclaims_dead_space_and_data_survives(tmp_path):
    cap, seg = 8 * BLOCK, 4 * BLOCK
    opts = dict(capacity_bytes=cap, segment_bytes=seg, compact_threshold_bytes=2 * BLOCK)
    store = open_store(tmp_path, **opts)
    for i in range(8):
        store.put(key(i), payload(key(i), BLOCK))
    assert segment_files(tmp_path) == ["seg-000001.dat", "seg-000002.dat"]
    store.delete(key(1))
    store.delete(key(3))  # segment 1 is now half dead
    assert store.stats().extra["dead_bytes"] == 2 * BLOCK
    store.put(key(8), payload(key(8), BLOCK))
    extra = store.stats().extra
    assert extra["compactions"] == 1 and extra["compacted_bytes"] == 2 * BLOCK
    assert "seg-000001.dat" not in segment_files(tmp_path)
    assert extra["dead_bytes"] == 0 and store.stats().evictions == 0
    survivors = [0, 2, 4, 5, 6, 7, 8]
    for i in survivors:
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), BLOCK))
    store.check_integrity()
    store.close()
    store = open_store(tmp_path, **opts)
    assert sorted(store.keys()) == sorted(key(i) for i in survivors)
    for i in survivors:
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), BLOCK))
    store.check_integrity()
    store.close()


def test_compaction_skips_segments_with_pinned_blocks(tmp_path):
    store = open_store(tmp_path, capacity_bytes=4 * BLOCK, segment_bytes=2 * BLOCK,
                       compact_threshold_bytes=BLOCK)
    for i in range(4):
        store.put(key(i), payload(key(i), BLOCK))
    store.pin(key(0))
    loc = store.locate(key(0))
    store.delete(key(1))  # segment 1: key 0 (pinned) and a dead block
    store.put(key(4), payload(key(4), BLOCK))
    assert store.locate(key(0)) == loc  # not moved: segment 1 was skipped
    assert "seg-000001.dat" in segment_files(tmp_path)
    # Room came from segment 2 instead: key 2 evicted, key 3 moved, the segment deleted.
    assert key(2) not in store and store.stats().extra["compactions"] == 1
    assert "seg-000002.dat" not in segment_files(tmp_path)
    for i in (0, 3, 4):
        np.testing.assert_array_equal(store.get(key(i)), payload(key(i), BLOCK))
    store.unpin(key(0))
    store.check_integrity()
    store.close()
