"""A reader's pins granted together are one run of leases: consecutive ids, one expiry, given
back in one call. Each pin of a run still ends by its own id, once; a pin taken, held or ended
alone leaves the rest of its run held; expiry, an owner's release and a forgotten key reach the
pins inside runs as they reach a lease of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from plane import Plane, make_plane
from scenarios import BLOCK, blocks, check, small_config

from cmx.actors.tiers.leases import ADMIN, Leases
from cmx.tiers import Tier

NODE = f"runs-{uuid.uuid4().hex[:6]}"


class Given:
    """What a run gave back: each call's keys, and each single lease's key."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def keys(self) -> list[bytes]:
        return sorted(k for call in self.calls for k in call)

    def undo(self, key: bytes):  # type: ignore[no-untyped-def]
        return lambda _lease: self.calls.append([key])

    def undo_keys(self, keys: list[bytes]) -> None:
        self.calls.append(list(keys))


def key(i: int) -> bytes:
    return bytes([i]) * 32


def grant(leases: Leases, given: Given, n: int, owner: str = "client:a") -> list[int]:
    ids = leases.grant_pins(owner, [key(i) for i in range(n)], given.undo, given.undo_keys)
    assert ids is not None
    return ids


def test_a_run_is_given_back_in_one_call_and_each_pin_once() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    ids = grant(leases, given, 5)
    assert ids == list(range(ids[0], ids[0] + 5)) and len(leases) == 5
    assert leases.stats().pinned == 5 and leases.stats().reserved == 0
    assert leases.end([ids[1], ids[3], ids[3]]) == 2  # a repeated id ends its pin once
    assert given.calls == [[key(1), key(3)]] and len(leases) == 3
    assert leases.end(ids) == 3 and given.keys() == sorted(key(i) for i in range(5))
    assert leases.end(ids) == 0 and len(leases) == 0 and not leases._runs
    more = grant(leases, given, 2)
    assert more[0] > ids[-1]  # ids are never handed out twice


def test_ids_that_name_no_pin_end_nothing() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    ids = grant(leases, given, 3)
    junk: list = [ids[0] - 1, ids[-1] + 1, -5, 0, 1 << 70, b"x" * 32, "7", 2.5, True]
    assert leases.end(junk) == 0 and given.calls == [] and len(leases) == 3


def test_unhashable_ids_are_passed_over_and_the_rest_end() -> None:
    """A remote caller's list of lease ids with a list, an array or a dict in it: those name no
    pin and are passed over; the ids beside them end, held alone or in a run, each once."""
    from cmx.actors.tiers.leases import LeaseKind

    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    ids = grant(leases, given, 3)
    alone = leases.grant("client:a", LeaseKind.PIN, key(7), given.undo(key(7)))
    junk: list = [[1], np.array([ids[0]]), {"id": ids[1]}, bytearray(b"x")]
    assert leases.end([*junk, alone, ids[0], ids[2], *junk]) == 3
    assert given.keys() == sorted([key(0), key(2), key(7)]) and len(leases) == 1
    assert leases.end(junk) == 0 and len(leases) == 1


def test_a_pin_taken_alone_leaves_the_rest_of_its_run() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    ids = grant(leases, given, 4)
    held = leases.take(ids[2])
    assert held is not None and held.key == key(2) and held.owner == "client:a"
    assert leases.take(ids[2]) is None and len(leases) == 3
    held.undo(ids[2])  # its holder gives it back itself, as abort does
    assert given.calls == [[key(2)]]
    assert leases.end(ids) == 3 and given.keys() == sorted(key(i) for i in range(4))


def test_a_pin_held_alone_and_its_run_end_together_each_once() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    ids = grant(leases, given, 4)
    assert leases.hold([ids[1]], ttl_s=100.0) == 1  # out of its run, a lease of its own
    assert leases.end([ids[1], ids[1], ids[0], ids[3], ids[3]]) == 3
    assert given.calls == [[key(1)], [key(0), key(3)]] and len(leases) == 1
    assert leases.end(iter(ids)) == 1 and given.keys() == sorted(key(i) for i in range(4))
    assert len(leases) == 0


def test_a_run_expires_whole_and_a_pin_held_longer_stays() -> None:
    now = [0.0]
    leases, given = Leases(10.0, clock=lambda: now[0]), Given()
    ids = grant(leases, given, 3)
    assert leases.hold([ids[0]], ttl_s=100.0) == 1  # as an operator's pin would be held
    now[0] = 10.0
    assert leases.expire() == 2 and given.keys() == [key(1), key(2)]
    assert leases.stats().expired == 2 and len(leases) == 1
    now[0] = 100.0
    assert leases.expire() == 1 and len(leases) == 0


def test_an_owners_release_and_a_forgotten_key_reach_pins_in_runs() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    mine = grant(leases, given, 3, owner="client:a")
    other = grant(leases, given, 3, owner="client:b")
    assert leases.forget_key(key(1)) == 2  # both runs' pins of it, nothing given back
    assert given.calls == [] and len(leases) == 4
    assert leases.release_owner("client:a") == 2
    assert given.keys() == [key(0), key(2)] and len(leases) == 2
    assert leases.end(mine + other) == 2 and len(leases) == 0


def test_an_operators_pins_are_a_lease_each() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    grant(leases, given, 3, owner=f"{ADMIN}:op")
    assert not leases._runs and len(leases) == 3
    assert leases.end_one(ADMIN, key(1)) and given.calls == [[key(1)]]


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,))
    yield p
    p.close()


def test_a_tiers_prefix_pins_end_by_id_in_any_split(plane: Plane) -> None:
    dram = plane.tiers[(NODE, Tier.DRAM)]
    keys, payload = blocks(6, seed=61)
    plane.agents[NODE].store(keys, [None, *keys[:-1]], payload)
    first = dram.pin_columns(keys, owner="client:x")
    second = dram.pin_columns(keys[:3], owner="client:y")
    assert first.held.all() and second.held.all()
    assert sorted(len(r.keys) for r in dram.leases._runs.values()) == [3, 6]  # a record each
    ids = first.lease.tolist()
    assert dram.stats().pinned == 6
    dram.unpin(ids[:2] + second.lease.tolist())
    assert dram.stats().pinned == 4 and dram.evict(keys[:2]) == 2  # theirs alone ended
    assert dram.evict(keys[2:]) == 0
    dram.abort([ids[2]])  # a pin ended as abort ends one: the rest stays pinned
    assert dram.evict(keys[2:3]) == 1 and dram.evict(keys[3:]) == 0
    dram.unpin(ids)
    assert dram.stats().pinned == 0 and dram.evict(keys[3:]) == 3
    assert np.asarray(payload).size == 6 * BLOCK
    check(plane)


def test_a_prefix_quarantined_while_pinned_goes_at_its_runs_last_unpin(plane: Plane) -> None:
    dram = plane.tiers[(NODE, Tier.DRAM)]
    keys, payload = blocks(3, seed=62)
    plane.agents[NODE].store(keys, [None, *keys[:-1]], payload)
    pins = dram.pin_columns(keys, owner="client:q")
    assert dram.quarantine(keys[1:2]) == 1
    assert keys[1] in dram.store  # pinned: it goes at the last unpin
    dram.unpin(pins.lease.tolist())
    assert keys[1] not in dram.store and keys[0] in dram.store
    check(plane)


def test_a_commit_of_a_pins_lease_is_refused_and_gives_the_pin_back(plane: Plane) -> None:
    """A lease that names a pin, not a reservation, sent to commit (a confused or hostile
    caller): refused, and the pin it took ends, as ``abort`` ends one."""
    dram = plane.tiers[(NODE, Tier.DRAM)]
    keys, payload = blocks(3, seed=63)
    plane.agents[NODE].store(keys, [None, *keys[:-1]], payload)
    pins = dram.pin_columns(keys, owner="client:c")
    single = dram.pin([keys[0]], owner="client:d")[0]
    assert dram.commit([(int(pins.lease[1]), BLOCK, 0), (single.lease, BLOCK, 0)]) == 0
    assert dram.stats().pinned == 2  # keys 0 and 2, of the run
    dram.unpin(pins.lease.tolist())
    assert dram.stats().pinned == 0 and dram.evict(keys) == 3
    check(plane)


def test_numpy_ids_end_pins_of_a_run_as_ints_do() -> None:
    leases, given = Leases(10.0, clock=lambda: 0.0), Given()
    ids = np.asarray(grant(leases, given, 3), np.int64)
    assert leases.take(ids[0]) is not None
    assert leases.end(list(ids[1:])) == 2 and len(leases) == 0
