"""LRU's victim order, read in chunks while the caller evicts and touches."""

from __future__ import annotations

from cmx.policies.eviction.lru import LRUPolicy


def _keys(n: int) -> list[bytes]:
    return [b"k%04d" % i for i in range(n)]


def test_victims_come_oldest_first_past_every_chunk() -> None:
    lru = LRUPolicy()
    keys = _keys(1000)
    for k in keys:
        lru.insert(k, None)
    assert list(lru.victims(lambda k: True)) == keys


def test_a_caller_may_evict_and_touch_while_it_reads() -> None:
    lru = LRUPolicy()
    keys = _keys(200)
    for k in keys:
        lru.insert(k, None)
    got = []
    for k in lru.victims(lambda k: k != keys[0]):  # the oldest is pinned
        got.append(k)
        lru.remove(k)  # evicted as it is read
        if k == keys[40]:
            lru.touch(keys[180])  # not yet read, now the newest: it comes last
    assert got == keys[1:180] + keys[181:] + [keys[180]]
    lru.check_integrity()
    assert list(lru.victims(lambda k: True)) == [keys[0]]


def test_victims_under_random_evictions_and_touches_keep_their_promises() -> None:
    import random

    for seed in range(20):
        rng = random.Random(seed)
        lru = LRUPolicy()
        keys = _keys(rng.randrange(1, 600))
        for k in keys:
            lru.insert(k, None)
        pinned = frozenset(rng.sample(keys, len(keys) // 3))
        offered: list[bytes] = []
        for k in lru.victims(lambda k, p=pinned: k not in p):
            assert k not in pinned and k in lru
            offered.append(k)
            roll = rng.random()
            if roll < 0.5:
                lru.remove(k)  # evicted
            elif roll < 0.7:
                touched = rng.choice(keys)
                if touched in lru:
                    lru.touch(touched)
        assert len(offered) == len(set(offered))  # never twice
        # Every key still resident and evictable was offered.
        assert {k for k in keys if k in lru and k not in pinned} <= set(offered)
        lru.check_integrity()


def test_a_prefix_touched_at_once_orders_as_its_keys_touched_one_by_one() -> None:
    import random

    from cmx.policies import EVICTION_POLICIES, make_eviction

    rng = random.Random(3)
    keys = _keys(300)
    for name in EVICTION_POLICIES:
        one, many = make_eviction(name), make_eviction(name)
        for policy in (one, many):
            for k in keys:
                policy.insert(k, None)
        for _ in range(5):
            hit = rng.sample(keys, 120) + [b"never-stored"] + keys[:3]  # a repeat, a stranger
            for k in hit:
                one.touch(k)
            many.touch_many(hit)
        assert list(one.victims(lambda k: True)) == list(many.victims(lambda k: True)), name
        many.check_integrity()
