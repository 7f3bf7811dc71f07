"""The directory shard and the event publisher, without Ray."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cmx.actors.directory.shard import ApplyResult, Copy, DirectoryShard, Entry, Source, shard_of
from cmx.actors.tiers.events import EventPublisher
from cmx.doors import Request
from cmx.storage.base import EventKind, StoreEvent
from cmx.tiers import Tier

A = Source("node-a", Tier.DRAM)
B = Source("node-b", Tier.NVME)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def stored(i: int, size: int = 100) -> Entry:
    return Entry(key(i), True, size, 1000 + i)


def test_apply_in_order_then_lookup_lists_every_copy() -> None:
    shard = DirectoryShard()
    assert shard.apply(A, "e1", 2, [stored(1), stored(2)]) is ApplyResult.NEED_RESYNC
    shard.resync(A, "e1", 0, [])
    assert shard.apply(A, "e1", 2, [stored(1), stored(2)]) is ApplyResult.OK
    shard.resync(B, "e9", 1, [stored(2)])
    found = shard.lookup([key(1), key(2), key(3)])
    assert found[0] == [Copy(Tier.DRAM, "node-a", 100, 1001)]
    assert sorted(c.tier.value for c in found[1]) == ["dram", "nvme"]
    assert found[2] == []
    shard.check_integrity()


def test_gap_new_epoch_and_duplicates() -> None:
    shard = DirectoryShard()
    shard.resync(A, "e1", 1, [stored(1)])
    assert shard.apply(A, "e1", 3, [stored(3)]) is ApplyResult.NEED_RESYNC  # seq 2 lost
    assert shard.apply(A, "e1", 1, [stored(1)]) is ApplyResult.OK  # duplicate, ignored
    assert shard.apply(A, "e2", 1, [stored(5)]) is ApplyResult.NEED_RESYNC  # restarted source
    assert shard.lookup([key(3), key(5)]) == [[], []]
    shard.check_integrity()


def test_removal_and_drop_source() -> None:
    shard = DirectoryShard()
    shard.resync(A, "e", 0, [])
    shard.resync(B, "e", 0, [])
    shard.apply(A, "e", 2, [stored(1), stored(2)])
    shard.apply(B, "e", 1, [stored(1)])
    shard.apply(A, "e", 3, [Entry(key(1), False)])
    assert shard.lookup([key(1)]) == [[Copy(Tier.NVME, "node-b", 100, 1001)]]
    assert shard.drop_source(A) == 1
    assert shard.lookup([key(2)]) == [[]]
    assert len(shard) == 1
    shard.check_integrity()


class Holdings:
    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.lock = threading.RLock()
        self.seq = 0

    def event(self, pub: EventPublisher, i: int, stored_: bool = True) -> None:
        with self.lock:
            self.seq += 1
            if stored_:
                self.entries[key(i)] = stored(i)
            else:
                self.entries.pop(key(i), None)
            kind = EventKind.STORED if stored_ else EventKind.REMOVED
            pub.on_event(StoreEvent(self.seq, kind, key(i), 100, 1000 + i))


def make(num_shards: int = 3):
    shards = [DirectoryShard(i) for i in range(num_shards)]
    holdings = Holdings()

    def send(shard: int, request: Request[Any]) -> object:
        return getattr(shards[shard], request.method)(**request.kwargs())

    pub = EventPublisher(A, "e1", num_shards, send, lambda: list(holdings.entries.values()),
                         holdings.lock)
    return shards, holdings, pub


def lookup_all(shards: list[DirectoryShard], keys: list[bytes]) -> list[bool]:
    return [bool(shards[shard_of(k, len(shards))].lookup([k])[0]) for k in keys]


def test_publisher_first_contact_resyncs_then_streams() -> None:
    shards, holdings, pub = make()
    for i in range(20):
        holdings.event(pub, i)
    assert pub.flush()
    assert all(lookup_all(shards, [key(i) for i in range(20)]))
    holdings.event(pub, 3, stored_=False)
    holdings.event(pub, 30)
    assert pub.flush()
    assert lookup_all(shards, [key(3), key(30)]) == [False, True]
    for s in shards:
        s.check_integrity()


def test_restarted_shard_is_rebuilt_by_heartbeat() -> None:
    shards, holdings, pub = make()
    for i in range(12):
        holdings.event(pub, i)
    pub.flush()
    victim = shard_of(key(0), 3)
    shards[victim] = DirectoryShard(victim)  # the shard restarted empty
    assert not lookup_all(shards, [key(0)])[0]
    pub.flush(heartbeat=True)  # empty batches
    assert all(lookup_all(shards, [key(i) for i in range(12)]))


def test_unreachable_shard_is_a_failure_not_an_error() -> None:
    shards, holdings, pub = make(1)

    def broken(shard: int, request: Request[Any]) -> object:
        raise ConnectionError("down")

    pub._send = broken
    holdings.event(pub, 1)
    assert pub.flush() is False
    assert pub.failures == 1
    pub._send = lambda shard, request: getattr(shards[shard], request.method)(
        **request.kwargs())
    holdings.event(pub, 2)
    assert pub.flush()  # the gap makes the shard ask for a resync: both blocks are back
    assert lookup_all(shards, [key(1), key(2)]) == [True, True]


def test_one_unreachable_shard_does_not_hold_back_the_others() -> None:
    shards, holdings, pub = make(3)
    down = shard_of(key(0), 3)
    sent: list[int] = []

    def send(shard: int, request: Request[Any]) -> object:
        sent.append(shard)
        if shard == down:
            raise ConnectionError("down")
        return getattr(shards[shard], request.method)(**request.kwargs())

    pub._send = send
    for i in range(12):
        holdings.event(pub, i)
    assert pub.flush() is False
    assert pub.failures == 1
    found = lookup_all(shards, [key(i) for i in range(12)])
    assert found == [shard_of(key(i), 3) != down for i in range(12)]
    sent.clear()
    assert pub.flush() is False  # only the failed batch is pending: only its shard is asked
    assert sent == [down, down]  # it failed at once: sent again at once, then kept
    down = -1
    assert pub.flush()
    assert all(lookup_all(shards, [key(i) for i in range(12)]))


def dropping(shards: list[DirectoryShard], drops: list[int]) -> Any:
    """A send that fails the Apply calls whose numbers (from 0) are in ``drops``."""
    calls = [0]

    def send(shard: int, request: Request[Any]) -> object:
        n, calls[0] = calls[0], calls[0] + 1
        if request.method == "apply" and n in drops:
            raise ConnectionError("connection reset")
        return getattr(shards[shard], request.method)(**request.kwargs())
    return send


def test_a_call_dropped_once_leaves_no_block_unlisted() -> None:
    # A store's commit right after a link came back: its one Apply call is reset. The blocks
    # were stored; a lookup right after the commit must list them, not wait for a heartbeat.
    shards, holdings, pub = make(1)
    for i in range(3):
        holdings.event(pub, i)
    assert pub.flush()  # first contact: the shard now counts this source's events
    pub._send = dropping(shards, [0])
    for i in range(3, 6):
        holdings.event(pub, i)
    assert pub.flush()
    assert lookup_all(shards, [key(i) for i in range(6)]) == [True] * 6
    assert pub.failures == 0


def test_a_batch_refused_twice_goes_with_the_next_flush() -> None:
    shards, holdings, pub = make(1)
    holdings.event(pub, 0)
    assert pub.flush()
    pub._send = dropping(shards, [0, 1])  # refused, and refused again at once
    holdings.event(pub, 1)
    assert pub.flush() is False
    assert lookup_all(shards, [key(0), key(1)]) == [True, False]
    holdings.event(pub, 1, stored_=False)  # a later event of the same block, in order after
    holdings.event(pub, 2)
    resyncs = pub.resyncs
    assert pub.flush()
    assert lookup_all(shards, [key(0), key(1), key(2)]) == [True, False, True]
    assert pub.resyncs == resyncs
    shards[0].check_integrity()


def test_a_batch_whose_call_timed_out_is_left_to_the_heartbeats_resync(monkeypatch: Any) -> None:
    import cmx.actors.tiers.events as events

    monkeypatch.setattr(events, "RETRY_WITHIN_S", 0.0)  # every failure as slow as a timeout
    shards, holdings, pub = make(1)
    holdings.event(pub, 0)
    assert pub.flush()
    sent: list[str] = []
    send = dropping(shards, [0])

    def counted(shard: int, request: Request[Any]) -> object:
        sent.append(request.method)
        return send(shard, request)

    pub._send = counted
    holdings.event(pub, 1)
    assert pub.flush() is False
    assert sent == ["apply"]  # not again at once: it would wait as long again
    assert pub.flush()  # nothing kept: the next commit's flush waits on no shard
    assert sent == ["apply"]
    assert pub.flush(heartbeat=True)  # the gap: the shard asks for the holdings
    assert lookup_all(shards, [key(0), key(1)]) == [True, True]


def test_kept_batches_are_bounded_and_the_gap_resyncs(monkeypatch: Any) -> None:
    import cmx.actors.tiers.events as events

    monkeypatch.setattr(events, "KEEP_ENTRIES", 4)
    shards, holdings, pub = make(1)
    holdings.event(pub, 0)
    assert pub.flush()
    pub._send = dropping(shards, [0, 1])
    for i in range(1, 7):
        holdings.event(pub, i)
    assert pub.flush() is False  # six entries failed: more than are kept
    assert pub.flush(heartbeat=True)  # the gap: the shard asks for the holdings
    assert all(lookup_all(shards, [key(i) for i in range(7)]))
    assert pub.resyncs == 2  # first contact, then the gap


@pytest.mark.parametrize("later_stored", [False, True])
def test_a_batch_a_failed_resync_replaced_is_not_sent_again(later_stored: bool) -> None:
    # Its first send landed but both answers were lost (kept); the next flush's Apply finds
    # the shard ahead (NEED_RESYNC), one more event is emitted meanwhile, and the Resync is
    # reset. Sent again, the old batch would be numbered onto the snapshot's count and line up
    # with the shard's cursor: a removed block listed, or a stored one never listed.
    shard = DirectoryShard(0)
    holdings = Holdings()
    mode = ["ok"]

    def send(s: int, request: Request[Any]) -> object:
        if mode[0] == "landed" and request.method == "apply":
            shard.apply(**request.kwargs())
            raise ConnectionError("connection reset")
        if mode[0] == "resync-reset":
            if request.method == "resync":
                raise ConnectionError("connection reset")
            mode[0] = "resync-reset-after"
            answer = shard.apply(**request.kwargs())
            holdings.event(pub, 3 if later_stored else 1, stored_=later_stored)
            return answer
        if mode[0] == "resync-reset-after" and request.method == "resync":
            raise ConnectionError("connection reset")
        return getattr(shard, request.method)(**request.kwargs())

    pub = EventPublisher(A, "e1", 1, send, lambda: list(holdings.entries.values()),
                         holdings.lock)
    holdings.event(pub, 0)
    assert pub.flush()
    mode[0] = "landed"
    holdings.event(pub, 1)
    assert pub.flush() is False
    holdings.event(pub, 2)
    mode[0] = "resync-reset"
    assert pub.flush() is False
    mode[0] = "ok"
    for _ in range(2):
        assert pub.flush(heartbeat=True)
    held = [0, 1, 2, 3] if later_stored else [0, 2]
    assert lookup_all([shard], [key(i) for i in range(4)]) == [i in held for i in range(4)]
    shard.check_integrity()


def test_a_closed_publisher_still_delivers_from_the_callers_thread() -> None:
    before = set(threading.enumerate())
    shards, holdings, pub = make()
    for i in range(6):
        holdings.event(pub, i)
    assert pub.flush()  # to every shard at once: the sending threads exist now
    pub.close()
    for i in range(6, 12):
        holdings.event(pub, i)
    pub.flush_soon()  # after close: delivered before it returns, no thread started
    assert lookup_all(shards, [key(i) for i in range(12)]) == [True] * 12
    for i in range(12, 18):
        holdings.event(pub, i)
    assert pub.flush()
    assert lookup_all(shards, [key(i) for i in range(18)]) == [True] * 18
    senders = [t for t in set(threading.enumerate()) - before if t.name.startswith("cmx-publish")]
    assert senders  # the first flush did start them
    for t in senders:
        t.join(timeout=30)  # closed: each ends once idle
    assert not [t for t in senders if t.is_alive()]
