"""Eviction policies: LRU and S3-FIFO orders, prefix awareness, and the books under random use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmx.policies import EVICTION_POLICIES, EvictionPolicy, make_eviction
from cmx.policies.eviction.lru import LRUPolicy
from cmx.policies.eviction.s3fifo import S3FIFOPolicy

POLICIES = sorted(EVICTION_POLICIES)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def ids(keys: list[bytes]) -> list[int]:
    return [int.from_bytes(k, "little") for k in keys]


def order(policy: EvictionPolicy, can_evict: object = None) -> list[int]:
    """Every candidate, best first (what a store sees if it never finds room)."""
    return ids(list(policy.victims(can_evict or (lambda k: True))))  # type: ignore[arg-type]


def unpinned(pinned: frozenset[int]) -> Callable[[bytes], bool]:
    return lambda k: ids([k])[0] not in pinned


def evict(policy: EvictionPolicy, can_evict: object = None) -> int:
    """What a store does: take the first candidate and remove it."""
    victim = next(policy.victims(can_evict or (lambda k: True)))  # type: ignore[arg-type]
    policy.remove(victim)
    return ids([victim])[0]


class Cache:
    """A fixed number of blocks over a policy, as a store drives it."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy, self.capacity = policy, capacity

    def store(self, i: int, parent: int | None = None) -> None:
        if i in ids(list(self.policy._parent)):
            self.policy.touch(key(i))
            return
        if len(self.policy) >= self.capacity:
            evict(self.policy)
        self.policy.insert(key(i), None if parent is None else key(parent))

    def hit(self, i: int) -> None:
        self.policy.touch(key(i))

    def resident(self) -> set[int]:
        return set(ids(list(self.policy._parent)))


# -- the registry -----------------------------------------------------------------------------


def test_the_registry_makes_fresh_policies() -> None:
    assert isinstance(make_eviction("lru"), LRUPolicy)
    assert isinstance(make_eviction("s3fifo"), S3FIFOPolicy)
    assert make_eviction("lru") is not make_eviction("lru")
    mine = S3FIFOPolicy()
    assert make_eviction(mine) is mine
    with pytest.raises(ValueError, match="unknown eviction policy 'arc'"):
        make_eviction("arc")
    with pytest.raises(ValueError):
        S3FIFOPolicy(small_ratio=1.5)


# -- LRU --------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_stored_or_hit() -> None:
    lru = make_eviction("lru")
    for i in range(4):
        lru.insert(key(i))
    lru.touch(key(0))
    lru.insert(key(2))  # storing again counts as a hit
    assert order(lru) == [1, 3, 0, 2]
    lru.check_integrity()


# -- S3-FIFO ----------------------------------------------------------------------------------


def test_s3fifo_sends_one_hit_wonders_first() -> None:
    s3 = make_eviction("s3fifo")
    for i in range(5):
        s3.insert(key(i))
    s3.touch(key(0))
    s3.touch(key(2))
    assert evict(s3) == 1  # 0 was hit: it moves to the main queue instead
    assert evict(s3) == 3
    assert evict(s3) == 4
    s3.check_integrity()


@pytest.mark.parametrize("name, survives", [("s3fifo", True), ("lru", False)])
def test_a_scan_does_not_flush_reused_blocks_from_s3fifo(name: str, survives: bool) -> None:
    cache = Cache(make_eviction(name), capacity=10)
    for i in range(3):
        cache.store(i)
        cache.hit(i)
    for i in range(100, 150):  # fifty blocks stored once and never read
        cache.store(i)
    assert ({0, 1, 2} <= cache.resident()) is survives
    cache.policy.check_integrity()


def test_s3fifo_brings_a_ghost_back_to_the_main_queue() -> None:
    cache = Cache(make_eviction("s3fifo"), capacity=4)
    for i in range(4):
        cache.store(i)
    cache.store(4)  # 0 leaves the small queue and is remembered as a ghost
    assert 0 not in cache.resident()
    cache.store(0)  # back soon after: it goes to the main queue
    for i in range(10, 16):  # new one-hit blocks churn through the small queue
        cache.store(i)
    assert 0 in cache.resident()
    cache.policy.check_integrity()


def test_s3fifo_main_queue_gives_each_hit_one_more_pass_up_to_three() -> None:
    s3 = S3FIFOPolicy()
    for i in range(4):
        s3.insert(key(i))
        s3.touch(key(i))
    s3.insert(key(4))
    assert evict(s3) == 4  # on the way the hand promotes 0-3 to the main queue, hits reset
    for i, hits in ((1, 10), (2, 3), (3, 1)):
        for _ in range(hits):
            s3.touch(key(i))
    # 0 was not hit again; 3 had one pass left; 1 and 2 both capped at three, 1 is older
    assert [evict(s3) for _ in range(4)] == [0, 3, 1, 2]
    s3.check_integrity()


def test_s3fifo_moves_past_a_pinned_block_without_losing_it() -> None:
    s3 = make_eviction("s3fifo")
    for i in range(4):
        s3.insert(key(i))
    assert evict(s3, lambda k: k != key(0)) == 1
    assert order(s3, lambda k: k != key(0)) == [2, 3]
    assert [evict(s3) for _ in range(3)] == [2, 3, 0]  # passed over, it went to the back
    s3.check_integrity()


def test_s3fifo_scan_that_evicts_nothing_changes_nothing() -> None:
    s3 = S3FIFOPolicy()
    for i in range(8):
        s3.insert(key(i), key(i - 1) if i % 3 else None)
        for _ in range(i % 3):
            s3.touch(key(i))
    evict(s3)  # some blocks now sit in the main queue

    def books() -> tuple[object, ...]:
        return list(s3._small), list(s3._main), dict(s3._freq)

    before = books()
    assert order(s3, lambda k: False) == []  # every block pinned
    assert books() == before
    assert len(order(s3)) == len(s3)  # a full look without evicting is a look
    assert books() == before
    s3.check_integrity()


# -- prefix awareness, both policies ----------------------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_leaves_go_before_their_parents(name: str) -> None:
    policy = make_eviction(name)
    policy.insert(key(1))
    policy.insert(key(2), key(1))
    policy.insert(key(3), key(2))
    policy.insert(key(9))
    assert order(policy) == [3, 9, 1, 2]
    policy.check_integrity()


@pytest.mark.parametrize("name", POLICIES)
def test_orphans_go_first(name: str) -> None:
    policy = make_eviction(name)
    policy.insert(key(1))
    policy.insert(key(2), key(1))
    policy.insert(key(3), key(2))
    policy.insert(key(9))
    policy.remove(key(1))  # 2 can no longer be reached by a lookup
    assert order(policy)[0] == 2
    policy.insert(key(1))  # the parent comes back: 2 is reachable again
    assert order(policy) == [3, 9, 2, 1]  # interior blocks last, in the policy's order
    policy.insert(key(7), key(6))  # stored before its parent
    assert order(policy)[0] == 7
    policy.insert(key(6))
    assert order(policy)[0] != 7
    policy.check_integrity()


@pytest.mark.parametrize("name", POLICIES)
def test_the_integrity_check_names_the_numbers(name: str) -> None:
    policy = make_eviction(name)
    policy.insert(key(1))
    policy.insert(key(2), key(1))
    policy._orphans[key(2)] = None  # corrupt the books
    with pytest.raises(AssertionError, match="orphan=False"):
        policy.check_integrity()


# -- random use -------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "touch", "evict", "drain"]),
              st.integers(0, 11), st.none() | st.integers(0, 11),
              st.frozensets(st.integers(0, 11), max_size=4)),
    max_size=60,
)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_books_hold_under_random_use(name: str, steps: list) -> None:
    policy = make_eviction(name)
    parents: dict[int, int | None] = {}
    for op, i, parent, pinned in steps:
        can_evict = unpinned(pinned)
        if op == "insert":
            parent = None if parent == i else parent
            policy.insert(key(i), None if parent is None else key(parent))
            parents.setdefault(i, parent)
        elif op == "remove":
            policy.remove(key(i))
            parents.pop(i, None)
        elif op == "touch":
            policy.touch(key(i))
        elif op == "evict":
            victim = next(policy.victims(can_evict), None)
            if victim is not None:
                assert ids([victim])[0] not in pinned
                policy.remove(victim)
                parents.pop(ids([victim])[0])
        else:
            _check_full_order(order(policy, can_evict), parents, pinned)
        policy.check_integrity()
        assert set(ids(list(policy._parent))) == set(parents)


def _check_full_order(seen: list[int], parents: dict[int, int | None],
                      pinned: frozenset[int]) -> None:
    """Every evictable block exactly once: orphans, then leaves, then interior blocks."""
    assert len(seen) == len(set(seen))
    assert set(seen) == set(parents) - pinned
    has_kids = {p for p in parents.values() if p is not None and p in parents}

    def rank(i: int) -> int:
        parent = parents[i]
        if parent is not None and parent not in parents:
            return 0
        return 2 if i in has_kids else 1

    ranks = [rank(i) for i in seen]
    assert ranks == sorted(ranks), list(zip(seen, ranks))
