"""NvmeStore scenarios: bytes in and out, reopening, pins, bad input, events, closing."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from nvme_helpers import BLOCK, KiB, aligned_payload, key, open_store, payload, segment_files

from cmx.buffers import aligned_empty
from cmx.checksum import checksum
from cmx.errors import (
    BlockStateError,
    BlockTooLargeError,
    InvalidKeyError,
    StoreClosedError,
    StoreLockedError,
)
from cmx.storage import NvmeStore
from cmx.storage.base import EventKind

SIZES = [0, 1, 4095, 4096, 4097, 100_000, 128 * KiB, 128 * KiB + 1, BLOCK - 1, BLOCK]


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_put_then_get_returns_the_exact_bytes(tmp_path, aligned):
    store = open_store(tmp_path)
    for i, n in enumerate(SIZES):
        k = key(i)
        if aligned:
            data = aligned_payload(k, n)
        else:
            data = np.empty(n + 1, np.uint8)[1:]  # an odd address: the staged path
            data[:] = payload(k, n)
        assert store.put(k, data)
        assert k in store
    for i, n in enumerate(SIZES):
        got = store.get(key(i))
        assert got is not None and got.dtype == np.uint8
        np.testing.assert_array_equal(got, payload(key(i), n))
    assert store.stats().hits == len(SIZES)
    store.check_integrity()
    store.close()


def test_bytes_like_inputs_and_repeat_puts(tmp_path):
    store = open_store(tmp_path)
    raw = payload(key(1), 5000).tobytes()
    assert store.put(key(1), raw)
    assert store.put(key(2), memoryview(bytearray(raw)))
    assert not store.put(key(1), b"other bytes")  # already committed: a no-op
    assert store.get(key(1)).tobytes() == raw
    assert store.get(key(2)).tobytes() == raw
    assert store.get(key(3)) is None
    stats = store.stats()
    assert (stats.blocks, stats.hits, stats.misses) == (2, 2, 1)
    store.close()


def test_reopen_finds_every_flushed_block(tmp_path):
    store = open_store(tmp_path)
    sizes = {key(i): 1000 + 37_000 * i for i in range(6)}
    for k, n in sizes.items():
        store.put(k, payload(k, n), parent=None)
    store.flush()
    store.close()
    store = open_store(tmp_path)
    assert sorted(store.keys()) == sorted(sizes)
    for k, n in sizes.items():
        np.testing.assert_array_equal(store.get(k), payload(k, n))
    store.check_integrity()
    store.close()


def test_get_into_reads_into_aligned_and_unaligned_buffers(tmp_path):
    store = open_store(tmp_path)
    for i, n in enumerate([4096, 10_000, BLOCK]):
        store.put(key(i), payload(key(i), n))
    # Page-aligned slot, larger than the block: bytes past the block stay untouched.
    slot = aligned_empty(BLOCK + 4096)
    slot[:] = 0xAB
    assert store.get_into(key(1), slot)
    np.testing.assert_array_equal(slot[:10_000], payload(key(1), 10_000))
    assert (slot[10_000:] == 0xAB).all()
    # Unaligned destination goes through the staging buffer.
    odd = np.zeros(BLOCK + 1, np.uint8)[1:]
    assert store.get_into(key(2), odd)
    np.testing.assert_array_equal(odd, payload(key(2), BLOCK))
    exact = aligned_empty(4096)
    assert store.get_into(key(0), exact)
    np.testing.assert_array_equal(exact, payload(key(0), 4096))
    assert not store.get_into(key(9), slot)
    with pytest.raises(ValueError):
        store.get_into(key(2), aligned_empty(4096))  # too small: refused, nothing read
    with pytest.raises(ValueError):
        store.get_into(key(0), np.zeros(8192, np.uint8)[::2])  # not contiguous
    store.check_integrity()
    store.close()


def test_get_many_keeps_order_and_reports_misses(tmp_path):
    store = open_store(tmp_path, queue_depth=2, io_bytes=64 * KiB)
    sizes = [BLOCK, 3000, 200_000, BLOCK, 1]
    for i, n in enumerate(sizes):
        store.put(key(i), payload(key(i), n))
    wanted = [key(3), key(7), key(0), key(3), key(4), key(1), key(2)]
    got = store.get_many(wanted)
    assert got[1] is None
    n_of = {key(i): n for i, n in enumerate(sizes)}
    for k, arr in zip(wanted, got):
        if k in n_of:
            np.testing.assert_array_equal(arr, payload(k, n_of[k]))
    assert store.stats().misses == 1
    assert store.get_many([]) == []
    store.close()


def test_get_many_into_fills_each_buffer_and_reports_misses(tmp_path):
    store = open_store(tmp_path, queue_depth=2, io_bytes=64 * KiB)
    sizes = [BLOCK, 3000, 200_000, BLOCK]
    for i, n in enumerate(sizes):
        store.put(key(i), payload(key(i), n))
    arena = aligned_empty(5 * BLOCK)  # page-aligned slots of a block each: read directly
    arena[:] = 0xAB
    slots = [arena[j * BLOCK:(j + 1) * BLOCK] for j in range(5)]
    slots[4] = np.zeros(BLOCK + 1, np.uint8)[1:]  # unaligned: through staging
    wanted = [key(3), key(7), key(1), key(2), key(0)]
    assert store.get_many_into(wanted, slots) == [True, False, True, True, True]
    n_of = {key(i): n for i, n in enumerate(sizes)}
    for k, slot in zip(wanted, slots):
        if k in n_of:
            np.testing.assert_array_equal(slot[:n_of[k]], payload(k, n_of[k]))
    assert (slots[2][3000:] == 0xAB).all()  # bytes past a block are left alone
    assert (slots[1] == 0xAB).all()  # a miss writes nothing
    with pytest.raises(ValueError):
        store.get_many_into([key(0)], [aligned_empty(4096)])  # too small
    with pytest.raises(ValueError):
        store.get_many_into([key(0), key(1)], [slots[0]])  # one buffer for two keys
    frozen = aligned_empty(BLOCK)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        store.get_many_into([key(0)], [frozen])
    assert store.get_many_into([], []) == []
    store.check_integrity()
    store.close()


def test_bad_input_raises_and_changes_nothing(tmp_path):
    store = open_store(tmp_path, capacity_bytes=4 * BLOCK)
    store.put(key(0), payload(key(0), 1000))
    store.flush()
    before = (store.stats(), segment_files(tmp_path), os.path.getsize(tmp_path / "journal.log"))
    with pytest.raises(InvalidKeyError):
        store.put(b"short", b"x")
    with pytest.raises(InvalidKeyError):
        store.put("not bytes", b"x")  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        store.put(key(1), b"x", parent=b"bad parent")
    with pytest.raises(BlockTooLargeError):
        store.put(key(1), np.zeros(BLOCK + 1, np.uint8))
    big = open_store(tmp_path / "big", capacity_bytes=BLOCK, block_bytes=4 * BLOCK)
    with pytest.raises(BlockTooLargeError):  # fits block_bytes, not the whole capacity
        big.put(key(1), np.zeros(2 * BLOCK, np.uint8))
    assert len(big) == 0 and segment_files(tmp_path / "big") == []
    big.close()
    with pytest.raises(InvalidKeyError):
        store.get(b"\0" * 31)
    with pytest.raises(ValueError):
        store.read_runs([(key(0), 900, 200)])  # past the end of the block
    store.flush()
    after = (store.stats(), segment_files(tmp_path), os.path.getsize(tmp_path / "journal.log"))
    assert after == before
    assert key(1) not in store and len(store) == 1
    store.check_integrity()
    store.close()


def test_pins_nest_and_guard_deletion(tmp_path):
    store = open_store(tmp_path)
    store.put(key(0), payload(key(0), 100))
    assert not store.pin(key(5))
    assert store.pin(key(0)) and store.pin(key(0))
    assert store.stats().pinned == 1
    with pytest.raises(BlockStateError):
        store.delete(key(0))
    store.unpin(key(0))
    with pytest.raises(BlockStateError):
        store.delete(key(0))
    store.unpin(key(0))
    with pytest.raises(BlockStateError):
        store.unpin(key(0))
    assert store.delete(key(0))
    assert not store.delete(key(0))
    assert key(0) not in store and store.get(key(0)) is None
    store.check_integrity()
    store.close()


def test_events_follow_every_commit_and_removal(tmp_path):
    store = open_store(tmp_path)
    events = []
    store.subscribe(events.append)
    data = payload(key(0), 777)
    store.put(key(0), data)
    store.put(key(0), data)  # no event for a no-op
    store.delete(key(0))
    assert [(e.seq, e.kind, e.key, e.size) for e in events] == [
        (1, EventKind.STORED, key(0), 777),
        (2, EventKind.REMOVED, key(0), 777),
    ]
    assert events[0].checksum == checksum(data)
    store.close()


def test_closed_store_refuses_use_and_the_directory_is_locked(tmp_path):
    store = open_store(tmp_path)
    store.put(key(0), b"abc")
    with pytest.raises(StoreLockedError):
        open_store(tmp_path)
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.put(key(1), b"x"), lambda: store.get(key(0)),
                 lambda: key(0) in store, store.flush, store.stats, lambda: store.pin(key(0))):
        with pytest.raises(StoreClosedError):
            call()
    with open_store(tmp_path) as again:
        assert again.get(key(0)).tobytes() == b"abc"


def test_stats_report_engine_and_layout(tmp_path):
    store = open_store(tmp_path)
    store.put(key(0), payload(key(0), BLOCK))
    store.get(key(0))
    extra = store.stats().extra
    assert extra["io_engine"] == "threads" and extra["direct_io"] is True
    assert extra["segments"] == 1 and extra["dead_bytes"] == 0
    assert extra["io_size_histogram"] == {64 * KiB: BLOCK // (64 * KiB)}
    assert extra["read_amplification"] == 1.0
    store.close()


def test_concurrent_puts_and_gets_keep_the_books(tmp_path):
    store = open_store(tmp_path, capacity_bytes=12 * BLOCK, segment_bytes=2 * BLOCK)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(30):
                k = key(i, salt=bytes([t]))
                store.put(k, payload(k, 50_000 + 1000 * t))
                got = store.get(k)  # may already be evicted by another thread
                if got is not None:
                    np.testing.assert_array_equal(got, payload(k, 50_000 + 1000 * t))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store.check_integrity()
    assert store.stats().evictions > 0
    store.close()
    store = open_store(tmp_path, capacity_bytes=12 * BLOCK, segment_bytes=2 * BLOCK)
    for k in store.keys():
        t = next(t for t in range(4) if any(key(i, bytes([t])) == k for i in range(30)))
        np.testing.assert_array_equal(store.get(k), payload(k, 50_000 + 1000 * t))
    store.check_integrity()
    store.close()


def test_public_import_path():
    from cmx.storage import NvmeStore as Exported

    assert Exported is NvmeStore


def test_a_put_whose_write_fails_leaves_nothing_behind(tmp_path):
    store = open_store(tmp_path)
    store.put(key(0), payload(key(0), 5000))
    real = store._engine.submit_write

    def failing(requests):
        batch = real(requests)
        batch.wait()
        raise OSError(5, "injected write error")

    store._engine.submit_write = failing
    with pytest.raises(OSError):
        store.put(key(1), payload(key(1), 70_000))
    with pytest.raises(OSError):
        store.put(key(2), aligned_payload(key(2), BLOCK))
    store._engine.submit_write = real
    assert key(1) not in store and key(2) not in store and len(store) == 1
    assert store.stats().bytes_written == 5000
    store.check_integrity()
    assert store.put(key(1), payload(key(1), 70_000))  # the key is free to store again
    store.close()
    store = open_store(tmp_path)
    assert sorted(store.keys()) == sorted([key(0), key(1)])
    np.testing.assert_array_equal(store.get(key(1)), payload(key(1), 70_000))
    store.close()
