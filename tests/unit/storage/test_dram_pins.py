"""DramStore.pin_refs: a reader's whole prefix pinned and located in one step, counted and
touched in the eviction order as pins one key at a time would be."""

from __future__ import annotations

import pytest
from dram_helpers import MakeStore, key, payload

from cmx.checksum import checksum
from cmx.errors import BlockStateError


def test_pin_refs_pins_each_key_here_once_and_names_its_bytes(make_store: MakeStore) -> None:
    store = make_store(slots=4)
    for i in (1, 2, 3):
        store.put(key(i), payload(i, 1000 + i))
    refs = store.pin_refs([key(1), key(9), key(2), key(3), key(1)], skip={key(3)})
    assert [r is None for r in refs] == [False, True, False, True, False]
    for i, ref in ((1, refs[0]), (2, refs[2]), (1, refs[4])):
        assert ref is not None and ref.size == 1000 + i
        assert ref.checksum == checksum(payload(i, 1000 + i))
        slot = store.arena.slot_view(ref.slot)[: ref.size]
        assert slot.tobytes() == payload(i, 1000 + i).tobytes()
    assert store.stats().pinned == 2
    grants = [store.reserve(key(5)), store.reserve(key(6))]  # the second evicts an unpinned one
    assert key(1) in store and key(2) in store and key(3) not in store
    for grant in grants:
        store.abort(grant)
    for k in (key(1), key(2), key(1)):
        store.unpin(k)
    with pytest.raises(BlockStateError):
        store.unpin(key(1))  # each pin ended once
    assert store.stats().pinned == 0
    store.check_integrity()


def test_pin_refs_counts_and_touches_as_pins_one_by_one(make_store: MakeStore) -> None:
    """A prefix pinned in one call: a hit and a miss counted for each key asked (a skipped key
    is not asked), and the hits made the newest in the eviction order, in order."""
    store = make_store(slots=4)
    for i in (1, 2, 3, 4):
        store.put(key(i), payload(i, 100))
    for k in (key(1), key(2), key(3), key(4)):  # each one hit, in store order
        assert store.pin(k)
        store.unpin(k)
    hits, misses = store.stats().hits, store.stats().misses
    refs = store.pin_refs([key(2), key(9), key(1), key(4)], skip={key(4)})
    assert [r is None for r in refs] == [False, True, False, True]
    assert (store.stats().hits, store.stats().misses) == (hits + 2, misses + 1)
    for k in (key(2), key(1)):
        store.unpin(k)
    store.put(key(5), payload(5, 100))  # evicts the least recent: 3, untouched since its hit
    assert key(3) not in store and all(k in store for k in (key(1), key(2), key(4)))
    store.put(key(6), payload(6, 100))  # then 4 (skipped, so not touched), before 2 and 1
    assert key(4) not in store and key(1) in store and key(2) in store
    store.check_integrity()


def test_pin_refs_counts_what_it_asked_when_a_checksum_fails_part_way(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cmx.storage.dram as dram

    store = make_store(slots=4)
    for i in (1, 2):
        store.put(key(i), payload(i, 100))  # no checksum given: pin_refs computes it
    real, calls = dram.checksum, []

    def failing_second(data):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("checksum failed")
        return real(data)

    monkeypatch.setattr(dram, "checksum", failing_second)
    before = store.stats()
    with pytest.raises(MemoryError):
        store.pin_refs([key(1), key(9), key(2)])
    after = store.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)
    monkeypatch.undo()
    for k in (key(1), key(2)):  # pinned before the failure, as one pin at a time would be
        store.unpin(k)
    store.check_integrity()
