"""DramStore scenarios: bytes back, two-phase writes, pins, eviction, hooks, events, bad input."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
from dram_helpers import MakeStore, key, payload, snapshot

from cmx.checksum import checksum
from cmx.errors import (
    BlockStateError,
    BlockTooLargeError,
    InvalidKeyError,
    StoreClosedError,
    StoreFullError,
)
from cmx.storage.arena import SHM_DIR, read_slot
from cmx.storage.base import EventKind, StoreEvent
from cmx.storage.dram import DramStore

# -- bytes in, bytes out ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 5000])
def test_exact_bytes_come_back(make_store: MakeStore, size: int) -> None:
    store = make_store()
    data = payload(size, size)
    assert store.put(key(1), data) is True
    got = store.get(key(1))
    assert got is not None and got.dtype == np.uint8 and got.tobytes() == data.tobytes()
    out = np.zeros(5000, np.uint8)
    assert store.get_into(key(1), out) == size and out[:size].tobytes() == data.tobytes()
    assert store.stats().used_bytes == size
    store.check_integrity()


def test_any_contiguous_buffer_is_accepted(make_store: MakeStore) -> None:
    store = make_store(slots=5)
    raw = payload(7, 4000)
    sources = [raw.tobytes(), bytearray(raw.tobytes()), memoryview(raw.tobytes()),
               torch.from_numpy(raw.copy()), raw.view(np.uint16)]
    for i, src in enumerate(sources):
        store.put(key(i), src)
        assert store.get(key(i)).tobytes() == raw.tobytes()  # type: ignore[union-attr]
    store.check_integrity()


def test_get_hands_out_a_copy(make_store: MakeStore) -> None:
    store = make_store()
    store.put(key(1), payload(1))
    got = store.get(key(1))
    assert got is not None
    got[:] = 0
    assert store.get(key(1)).tobytes() == payload(1).tobytes()  # type: ignore[union-attr]


def test_a_second_put_of_a_key_is_a_no_op(make_store: MakeStore) -> None:
    store = make_store()
    assert store.put(key(1), payload(1))
    before = snapshot(store)
    assert store.put(key(1), payload(2)) is False
    assert snapshot(store) == before
    assert store.get(key(1)).tobytes() == payload(1).tobytes()  # type: ignore[union-attr]
    store.check_integrity()


# -- two-phase writes -------------------------------------------------------------------------


def test_a_reserved_block_is_invisible_until_commit(make_store: MakeStore) -> None:
    store = make_store()
    seen: list[StoreEvent] = []
    store.subscribe(seen.append)
    res = store.reserve(key(1), parent=key(0))
    res.buffer[:5000] = payload(1)
    assert key(1) not in store and store.get(key(1)) is None and len(store) == 0
    assert store.keys() == [] and store.pin(key(1)) is False and store.delete(key(1)) is False
    assert store.put(key(1), payload(2)) is False  # being written: no second writer
    assert store.stats().extra["reserved"] == 1 and seen == []
    store.commit(res, size=5000, checksum=42)
    assert key(1) in store and len(store) == 1
    assert store.get(key(1)).tobytes() == payload(1).tobytes()  # type: ignore[union-attr]
    assert seen == [StoreEvent(1, EventKind.STORED, key(1), 5000, 42)]
    store.check_integrity()


def test_abort_frees_the_slot_and_leaves_no_trace(make_store: MakeStore) -> None:
    store = make_store(slots=2)
    before = snapshot(store)
    reservations = [store.reserve(key(i)) for i in range(2)]
    assert store.stats().extra["free_slots"] == 0
    with pytest.raises(StoreFullError):
        store.reserve(key(9))
    for res in reservations:
        store.abort(res)
    assert snapshot(store) == before
    store.put(key(0), payload(0))
    store.check_integrity()


def test_a_fenced_slot_frees_its_key_but_stays_out_of_use_until_unfenced(
    make_store: MakeStore,
) -> None:
    store = make_store(slots=2)
    store.put(key(1), payload(1))
    res = store.reserve(key(0))
    slot = store.fence(res)
    assert store.stats().extra["fenced"] == 1 and store.stats().extra["reserved"] == 0
    store.check_integrity()
    with pytest.raises(BlockStateError):
        store.commit(res)  # its writer's commit finds nothing open
    again = store.reserve(key(0))  # the key is free at once; the slot is not
    assert again.slot != slot  # the stored block was evicted for it instead
    store.abort(again)
    store.unfence(slot)
    with pytest.raises(BlockStateError):
        store.unfence(slot)
    assert store.stats().extra["fenced"] == 0 and store.stats().extra["free_slots"] == 2
    store.check_integrity()


def test_a_reservation_closes_once(make_store: MakeStore) -> None:
    store = make_store()
    res = store.reserve(key(1))
    store.commit(res, size=10)
    with pytest.raises(BlockStateError):
        store.commit(res)
    with pytest.raises(BlockStateError):
        store.abort(res)
    with pytest.raises(BlockStateError):
        store.reserve(key(1))  # already stored
    stale = store.reserve(key(2))
    store.abort(stale)
    fresh = store.reserve(key(2))
    with pytest.raises(BlockStateError):
        store.commit(stale)  # an old reservation cannot commit the new one
    store.commit(fresh, size=0)
    assert store.get(key(2)).nbytes == 0  # type: ignore[union-attr]
    store.check_integrity()


def test_commit_refuses_a_size_the_slot_cannot_hold(make_store: MakeStore) -> None:
    store = make_store()
    res = store.reserve(key(1))
    before = snapshot(store)
    for bad, error in ((5001, BlockTooLargeError), (-1, ValueError), (1.5, ValueError)):
        with pytest.raises(error):
            store.commit(res, size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.commit(res, checksum=2**64)
    assert snapshot(store) == before
    store.commit(res)
    assert store.get(key(1)).nbytes == 5000  # type: ignore[union-attr]
    store.check_integrity()


# -- views, locations, other processes --------------------------------------------------------


def test_a_view_needs_a_pin_and_is_read_only(make_store: MakeStore) -> None:
    store = make_store()
    store.put(key(1), payload(1, 300))
    with pytest.raises(BlockStateError):
        store.view(key(1))
    assert store.view(key(2)) is None
    store.pin(key(1))
    view = store.view(key(1))
    assert view is not None and view.nbytes == 300 and view.tobytes() == payload(1, 300).tobytes()
    assert view.ctypes.data % 4096 == 0
    with pytest.raises(ValueError):
        view[0] = 1
    store.unpin(key(1))
    store.check_integrity()


def test_another_process_reads_a_committed_block_by_arena_name(make_store: MakeStore) -> None:
    store = make_store(slots=3, block_bytes=9000)
    data = payload(5, 8999)
    store.put(key(0), payload(0, 9000))
    store.put(key(5), data)
    assert store.pin(key(5))
    ref = store.locate(key(5))
    assert ref is not None and ref.arena == store.arena.name and ref.size == 8999
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = pool.submit(read_slot, ref).result(timeout=120)
    assert got.tobytes() == data.tobytes()
    store.unpin(key(5))
    assert store.locate(key(7)) is None
    assert os.path.exists(os.path.join(SHM_DIR, store.arena.name))  # the reader unlinked nothing
    store.check_integrity()


# -- events, checksums, stats -----------------------------------------------------------------


def test_events_follow_every_commit_and_removal(make_store: MakeStore) -> None:
    store = make_store(slots=2)
    events: list[StoreEvent] = []
    store.subscribe(events.append)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2, 10))
    store.put(key(3), payload(3))  # evicts 1
    store.delete(key(2))
    store.close()  # the rest is reported removed too
    kinds = [(e.kind, int.from_bytes(e.key, "little"), e.size) for e in events]
    assert kinds == [
        (EventKind.STORED, 1, 5000), (EventKind.STORED, 2, 10), (EventKind.REMOVED, 1, 5000),
        (EventKind.STORED, 3, 5000), (EventKind.REMOVED, 2, 10), (EventKind.REMOVED, 3, 5000),
    ]
    assert [e.seq for e in events] == list(range(1, 7))


def test_checksums_are_lazy_and_cached(make_store: MakeStore) -> None:
    store = make_store()
    store.put(key(1), payload(1))
    store.put(key(2), payload(2), checksum=12345)
    assert store.locate(key(1)).checksum is None  # type: ignore[union-attr]
    assert store.checksum_of(key(1)) == checksum(payload(1))
    assert store.locate(key(1)).checksum == checksum(payload(1))  # type: ignore[union-attr]
    assert store.checksum_of(key(2)) == 12345  # the caller's value is trusted, not recomputed
    assert store.checksum_of(key(3)) is None
    store.check_integrity()


def test_stats_count_what_happened(make_store: MakeStore) -> None:
    store = make_store(slots=2)
    store.put(key(1), payload(1, 100))
    store.get(key(1))
    store.get(key(2))
    store.pin(key(1))
    s = store.stats()
    assert (s.blocks, s.pinned, s.hits, s.misses, s.bytes_written, s.bytes_read) == (
        1, 1, 2, 1, 100, 100)
    assert s.capacity_bytes == 2 * 5000 and s.used_bytes == 100
    assert s.extra == {"arena": store.arena.name, "slot_bytes": 8192, "slots": 2,
                       "free_slots": 1, "reserved": 0, "fenced": 0, "eviction": "lru",
                       "evict_hook_errors": 0}
    store.unpin(key(1))
    store.check_integrity()


# -- bad input --------------------------------------------------------------------------------


def _bad_calls() -> list[tuple[str, Callable[[DramStore], object], type[Exception]]]:
    wide = np.zeros((100, 2), np.uint8)
    return [
        ("short key", lambda s: s.put(b"short", payload(1)), InvalidKeyError),
        ("str key", lambda s: s.put("k" * 32, payload(1)), InvalidKeyError),
        ("long key", lambda s: s.reserve(b"x" * 33), InvalidKeyError),
        ("bad parent", lambda s: s.put(key(5), payload(1), parent=b"p"), InvalidKeyError),
        ("own parent", lambda s: s.put(key(5), payload(1), parent=key(5)), InvalidKeyError),
        ("get", lambda s: s.get(b"k"), InvalidKeyError),
        ("contains", lambda s: b"k" in s, InvalidKeyError),
        ("pin", lambda s: s.pin(b"k"), InvalidKeyError),
        ("delete", lambda s: s.delete(b"k"), InvalidKeyError),
        ("too large", lambda s: s.put(key(5), payload(1, 5001)), BlockTooLargeError),
        ("strided numpy", lambda s: s.put(key(5), wide[:, 0]), ValueError),
        ("strided torch", lambda s: s.put(key(5), torch.zeros(10, 10).t()), ValueError),
        ("not a buffer", lambda s: s.put(key(5), 12), TypeError),
        ("bad checksum", lambda s: s.put(key(5), payload(1), checksum=-1), ValueError),
        ("small out", lambda s: s.get_into(key(1), np.zeros(10, np.uint8)), BlockTooLargeError),
        ("unpin unpinned", lambda s: s.unpin(key(1)), BlockStateError),
        ("unpin missing", lambda s: s.unpin(key(7)), BlockStateError),
        ("not a reservation", lambda s: s.commit("r"), TypeError),
    ]


@pytest.mark.parametrize("name, call, error", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_and_changes_nothing(make_store: MakeStore, name: str,
                                              call: Callable[[DramStore], object],
                                              error: type[Exception]) -> None:
    store = make_store(slots=2)
    store.put(key(1), payload(1))
    before = snapshot(store)
    with pytest.raises(error):
        call(store)
    assert snapshot(store) == before
    store.check_integrity()


def test_bad_construction_creates_nothing() -> None:
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(BlockTooLargeError):
        DramStore(capacity_bytes=4096, block_bytes=8192)
    with pytest.raises(BlockTooLargeError):  # the 4 KiB-rounded slot does not fit
        DramStore(capacity_bytes=6000, block_bytes=5000)
    for capacity, block in ((0, 10), (4096, 0), (4096, True)):
        with pytest.raises(ValueError):
            DramStore(capacity_bytes=capacity, block_bytes=block)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        DramStore(capacity_bytes=8192, block_bytes=4096, eviction="fifo")
    assert set(os.listdir(SHM_DIR)) == before


# -- life cycle and threads -------------------------------------------------------------------


def test_use_after_close_raises(make_store: MakeStore) -> None:
    store = make_store()
    store.put(key(1), payload(1))
    res = store.reserve(key(2))
    name = store.arena.name
    store.close()
    store.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    for call in (lambda: store.put(key(3), payload(3)), lambda: store.get(key(1)),
                 lambda: key(1) in store, lambda: len(store), lambda: store.keys(),
                 lambda: store.pin(key(1)), lambda: store.delete(key(1)),
                 lambda: store.stats(), lambda: store.check_integrity(),
                 lambda: store.commit(res), lambda: store.reserve(key(4)),
                 lambda: store.checksum_of(key(1))):
        with pytest.raises(StoreClosedError):
            call()


def test_threads_share_one_store(make_store: MakeStore) -> None:
    store = make_store(slots=8, block_bytes=4096)
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            for i in range(base, base + 200):
                store.put(key(i), payload(i, 4096))
                got = store.get(key(i - 3))
                if got is not None:
                    assert got.tobytes() == payload(i - 3, 4096).tobytes()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n * 1000 + 3,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store) == 8
    store.check_integrity()
