"""The directory's rebuild after a shard restart, replayed with a fault at every call of it.

Three sources (a node's DRAM and NVMe, a pool node) publish their stores and removals to one
shard through their ``EventPublisher``s. The shard starts again, empty, and learns everything
back: each source's next batch or heartbeat is answered NEED_RESYNC, and the source sends its
holdings (``resync``), while the sources go on storing and removing blocks, heartbeat by
heartbeat, and one of them starts again over its disk (a new epoch, resynced too). A dry run
counts the calls the shard gets; then the same run is replayed once per call and per fault at
that call:

- ``before``: the shard dies as the call reaches it, and starts again, empty; the call fails;
- ``after``: the shard handles the call, answers, and dies; it starts again, empty;
- ``lost``: a resync is lost on the way (the shard lives on, having asked for it).

After every step of every replay, nothing wrong is served: each copy the shard lists is held by
its source, and a namespace's listing is either refused (``UnavailableError``: the shard knows
it may not know every copy yet) or whole. Two heartbeats after the last step the shard lists
exactly what the sources hold, and ``check_integrity()`` holds. All plain classes, one clock.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from plane import FakeClock

from cmx.actors.directory.shard import DirectoryShard, Entry, Source
from cmx.actors.tiers.events import EventPublisher
from cmx.doors import Request, Resync
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.storage.base import EventKind, StoreEvent
from cmx.tiers import Tier

HEARTBEAT_S = 1.0
RESYNC_S = 3.0  # the service's: a heartbeat and a call's bound
NS = "0123456789abcdef"
FAULTS = ("before", "after", "lost")
ALL_KEYS = 12  # every key the workload stores


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())


class Holder:
    """A source's store: what it holds, its events published as a tier's are."""

    def __init__(self, source: Source, send: Callable[[int, Request[Any]], object]) -> None:
        self.held: dict[bytes, Entry] = {}
        self.lock = threading.RLock()
        self.source, self.send, self.epoch = source, send, 0
        self.publisher = self._publisher()
        self.seq = 0

    def _publisher(self) -> EventPublisher:
        self.epoch += 1
        return EventPublisher(self.source, f"{self.source.tier.value}-{self.epoch}", 1,
                              self.send, lambda: list(self.held.values()), self.lock,
                              lambda k: self.held[k].namespace)

    def restart(self, found: int) -> None:
        """Started again over its disk, which holds block ``found`` too (its last incarnation
        died between the block's commit and its announcement): a new epoch, announced at once."""
        k = key(found)
        self.held[k] = Entry(k, True, 4096, found + 1, NS)
        self.publisher.close()
        self.publisher = self._publisher()
        self.publisher.flush(heartbeat=True)

    def _event(self, kind: EventKind, entry: Entry) -> None:
        self.seq += 1
        self.publisher.on_event(StoreEvent(self.seq, kind, entry.key, entry.size,
                                           entry.checksum))

    def store(self, i: int) -> None:
        with self.lock:
            k = key(i)
            entry = self.held[k] = Entry(k, True, 4096, i + 1, NS)
            self._event(EventKind.STORED, entry)
        self.publisher.flush()

    def remove(self, i: int) -> None:
        with self.lock:
            entry = self.held.pop(key(i), None)
            if entry is not None:
                self._event(EventKind.REMOVED, Entry(entry.key, False))
        self.publisher.flush()


@dataclass
class Faulty:
    """The shard as its sources reach it, with a fault at call number ``at`` (from 0)."""

    clock: FakeClock
    at: int = -1
    fault: str = ""
    calls: int = 0
    shard: DirectoryShard = field(init=False)

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.shard = DirectoryShard(0, HEARTBEAT_S, RESYNC_S, self.clock)

    def send(self, _shard: int, request: Request[Any]) -> object:
        n, self.calls = self.calls, self.calls + 1
        if n == self.at and self.fault == "before":
            self.restart()
            raise UnavailableError("the shard died as the call reached it")
        if n == self.at and self.fault == "lost" and isinstance(request, Resync):
            raise UnavailableError("the resync was lost on the way")
        answer = getattr(self.shard, request.method)(**request.kwargs())
        if n == self.at and self.fault == "after":
            self.restart()
        return answer


def truth(holders: dict[Source, Holder]) -> dict[bytes, set[Source]]:
    out: dict[bytes, set[Source]] = {}
    for source, h in holders.items():
        for k in h.held:
            out.setdefault(k, set()).add(source)
    return out


def served(shard: DirectoryShard, keys: list[bytes]) -> dict[bytes, set[Source]]:
    out: dict[bytes, set[Source]] = {}
    for k, copies in zip(keys, shard.lookup(keys)):
        if copies:
            out[k] = {Source(c.node, c.tier) for c in copies}
    return out


def check_served(plane: Faulty, holders: dict[Source, Holder], where: str) -> None:
    """Nothing wrong: each listed copy is held, a namespace's listing whole or refused."""
    held = truth(holders)
    keys = [key(i) for i in range(ALL_KEYS)]
    for k, sources in served(plane.shard, keys).items():
        extra = sources - held.get(k, set())
        assert not extra, f"{where}: {k.hex()[:8]} listed on {extra}, which do not hold it"
    try:
        listing = plane.shard.namespace_blocks(NS)
    except UnavailableError:
        return
    got = {bytes(k): {Source(c.node, c.tier) for c in copies} for k, copies in listing}
    assert got == held, f"{where}: a namespace's listing of {len(got)} blocks, " \
                        f"{len(held)} held"


def heartbeat(plane: Faulty, holders: dict[Source, Holder]) -> None:
    plane.clock.advance(HEARTBEAT_S)
    for h in holders.values():
        h.publisher.flush(heartbeat=True)


def run(at: int = -1, fault: str = "") -> int:
    """The workload with ``fault`` at shard call ``at``; how many calls the shard got in
    its rebuild (the restart to the last step)."""
    plane = Faulty(FakeClock())
    sources = [Source("node-a", Tier.DRAM), Source("node-a", Tier.NVME),
               Source("pool-1", Tier.POOL)]
    holders = {s: Holder(s, plane.send) for s in sources}
    dram, nvme, pool = holders.values()
    for i in range(6):  # before the restart: learned as it happened
        dram.store(i)
        if i % 2:
            pool.store(i)
    for _ in range(3):
        heartbeat(plane, holders)
    # The faults are in the rebuild: its calls are counted from the restart.
    plane.calls, plane.at, plane.fault = 0, at, fault
    plane.restart()
    steps: list[Callable[[], None]] = [
        lambda: heartbeat(plane, holders),
        lambda: nvme.store(0),  # a demotion while the shard relearns: stored below, then
        lambda: dram.remove(0),  # removed above
        lambda: pool.store(6),
        lambda: heartbeat(plane, holders),
        lambda: dram.store(7),
        lambda: pool.remove(1),
        lambda: heartbeat(plane, holders),
        lambda: nvme.store(8),
        lambda: dram.remove(2),
        lambda: heartbeat(plane, holders),
        lambda: nvme.restart(10),  # the shard asks it for everything of its new epoch
        lambda: pool.store(9),
        lambda: heartbeat(plane, holders),
        lambda: nvme.remove(8),
        lambda: heartbeat(plane, holders),
    ]
    for n, step in enumerate(steps):
        step()
        check_served(plane, holders, f"{fault} call {at}, after step {n}")
    calls = plane.calls
    for _ in range(2):
        heartbeat(plane, holders)
    where = f"{fault} call {at}, two heartbeats after"
    keys = [key(i) for i in range(ALL_KEYS)]
    assert served(plane.shard, keys) == truth(holders), f"{where}: the shard lists other copies"
    assert len(plane.shard.namespace_blocks(NS)) == len(truth(holders)), where
    plane.shard.check_integrity()
    return calls


CALLS = run()


def test_the_rebuild_makes_enough_calls_to_replay() -> None:
    assert CALLS >= 20


@pytest.mark.parametrize(("at", "fault"), list(itertools.product(range(CALLS), FAULTS)))
def test_a_fault_at_any_call_of_the_rebuild_serves_nothing_wrong_and_heals(at: int,
                                                                          fault: str) -> None:
    run(at, fault)
