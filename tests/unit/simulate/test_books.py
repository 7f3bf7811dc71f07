"""The books a run keeps on every block: who holds it, a tier's eviction order, the plans the
engine reuses, and the collector's thresholds around the loop."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest

from cmx.simulate import SimConfig, Simulator
from cmx.simulate.cache import TierCache
from cmx.simulate.cluster import Holders
from cmx.simulate.collector import LOOP_THRESHOLDS, collect_in_batches

Configs = Callable[..., SimConfig]


def test_holders_add_remove_and_pick_by_place_in_constant_time() -> None:
    h = Holders()
    for node in (7, 3, 9, 3):
        h.add(node)
    assert h.nodes == [7, 3, 9] and len(h) == 3 and 3 in h and 4 not in h
    h.discard(7)  # the last holder takes the place of the one that left
    assert h.nodes == [9, 3] and dict(h) == {9: 0, 3: 1}
    h.discard(42)
    assert [h.pick(u) for u in (0.0, 0.49, 0.5, 0.99)] == [9, 9, 3, 3]
    h.discard(9)
    h.discard(3)
    assert not h and h.nodes == []


def test_a_full_tier_evicts_least_recently_used_first_across_many_inserts() -> None:
    cache = TierCache("t", capacity_bytes=300, eviction="lru")
    evicted: list[bytes] = []
    for key in (b"a", b"b", b"c"):
        assert cache.insert(key, None, 100) == []
    cache.touch(b"a")  # order, oldest first: b c a
    for key in (b"d", b"e"):
        evicted += cache.insert(key, None, 100) or []
    assert evicted == [b"b", b"c"]  # order now: a d e
    assert cache.insert(b"d", None, 100) == []  # a resident key is touched: a e d
    cache.pin(b"a")
    assert cache.insert(b"f", None, 100) == [b"e"]  # a pinned: e is the oldest evictable
    assert cache.insert(b"wide", None, 200) == [b"d", b"f"]  # two go for one
    assert cache.evictions == 5 and cache.used == 300
    assert cache.bytes_in == 800 and cache.bytes_out == 500
    assert sorted(cache.sizes) == [b"a", b"wide"]
    cache.check_integrity()


def test_every_plan_the_engine_reused_is_the_policys_plan_at_the_end_of_the_run(
    make_config: Configs,
) -> None:
    sim = Simulator(make_config(dram_gib=24))
    sim.run()
    assert sim._plans
    unit_bytes = sim.mover.unit_bytes
    for (classes, context), plan in sim._plans.items():
        assert sim.breakeven.plan([(c, unit_bytes) for c in classes], sim.unit,
                                  context) == plan


def test_the_loop_collects_in_batches_and_restores_the_thresholds_even_on_an_error() -> None:
    before = gc.get_threshold()
    with collect_in_batches():
        assert gc.get_threshold() == LOOP_THRESHOLDS
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), collect_in_batches():
        raise RuntimeError("a handler failed")
    assert gc.get_threshold() == before
