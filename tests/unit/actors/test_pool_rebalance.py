"""A pool rebalance leaves each block on its owners and only there: when a namespace's
replication is lowered, the pool nodes that no longer own a block drop their copy, each only
once every owner confirms a copy of the same checksum; the last copy never goes, and a copy a
reader has pinned goes when its pin ends. What is left loads with its bytes exact."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from plane import RUN, Plane, make_plane
from scenarios import blocks, check, load, small_config
from tagging import NS, PoolMembers, held_in, start_pool

from cmx.actors.pool.node import PoolNodeService
from cmx.actors.pool.rebalance import Rebalanced
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.policies.rendezvous import owners
from cmx.tiers import Tier

MEMBERS = ["pool-1", "pool-2", "pool-3"]
# Node names of this file alone: a tier unlinks the arenas its node's name left behind.
WRITER, READER = NODES = (f"rebal-w-{RUN}", f"rebal-r-{RUN}")  # apart from other runs' arenas
N = 4


@dataclass
class Pooled:
    plane: Plane
    pools: dict[str, PoolNodeService]
    keys: list[BlockHash]
    payload: np.ndarray

    def holders(self, key: BlockHash) -> list[str]:
        return [name for name, pool in self.pools.items() if pool.contains([key]) == [True]]

    def rebalance(self, replicas: int) -> dict[str, Rebalanced]:
        return {name: pool.rebalance(MEMBERS, replicas) for name, pool in self.pools.items()}

    def check(self) -> None:
        check(self.plane)
        for pool in self.pools.values():
            pool.check_integrity()


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[Pooled]:
    """``N`` blocks stored with replication 3: every pool node holds every one."""
    plane = make_plane(small_config(tmp_path, pool_admission_min_count=1), NODES)
    plane.link._targets["cmx:controller"] = PoolMembers(MEMBERS)  # type: ignore[attr-defined]
    pools = {name: start_pool(plane, name) for name in MEMBERS}
    try:
        keys, payload = blocks(N, seed=71)
        parents = [None, *keys[:-1]]
        assert plane.agents[WRITER].store(keys, parents, payload, NS, replicas=3) == N
        state = Pooled(plane, pools, keys, payload)
        assert all(state.holders(k) == MEMBERS for k in keys)
        yield state
        state.check()
    finally:
        for pool in pools.values():
            pool.close()
        plane.close()


def loads_exact(state: Pooled) -> None:
    """With every node's own copies evicted, the blocks load from the pool, bytes exact."""
    for tier in state.plane.tiers.values():
        tier.evict(state.keys)
    assert held_in(state.plane, state.keys) == {Tier.POOL}
    data, loaded = load(state.plane, READER, state.keys)
    assert [b.source_tier for b in loaded] == [Tier.POOL] * N
    assert np.array_equal(data, state.payload)


def test_lowering_replication_to_one_leaves_one_copy_on_the_owner(pooled: Pooled) -> None:
    done = pooled.rebalance(1)
    assert sum(r.dropped for r in done.values()) == 2 * N
    assert all(r.pushed == 0 and r.deferred == 0 for r in done.values())
    for key in pooled.keys:
        assert pooled.holders(key) == owners(key, MEMBERS, 1)
        copies = [c for c in pooled.plane.lookup([key])[0] if c.tier is Tier.POOL]
        assert [c.node for c in copies] == owners(key, MEMBERS, 1)
    loads_exact(pooled)
    assert pooled.rebalance(1) == {name: Rebalanced(0, 0, 0) for name in MEMBERS}


def test_lowering_replication_to_two_keeps_both_owners_copies(pooled: Pooled) -> None:
    pooled.rebalance(2)
    for key in pooled.keys:
        assert sorted(pooled.holders(key)) == sorted(owners(key, MEMBERS, 2))
    loads_exact(pooled)


def test_the_last_copy_stays_while_its_owner_cannot_confirm_one(pooled: Pooled) -> None:
    key = pooled.keys[0]
    owner = owners(key, MEMBERS, 1)[0]
    last = next(m for m in MEMBERS if m != owner)
    for name, pool in pooled.pools.items():
        if name != last:
            assert pool.evict([key]) == 1
    targets = pooled.plane.link._targets  # type: ignore[attr-defined]
    away = targets.pop(actor_name("pool", owner))  # its owner does not answer
    pooled.pools[last].rebalance(MEMBERS, 1)
    assert pooled.holders(key) == [last]
    targets[actor_name("pool", owner)] = away  # it answers again: it pulls, then confirms
    done = pooled.pools[last].rebalance(MEMBERS, 1)
    assert done.pushed >= 1 and pooled.holders(key) == [owner]
    loads_exact(pooled)


def test_a_surplus_copy_under_a_pin_goes_when_the_pin_ends(pooled: Pooled) -> None:
    key = pooled.keys[0]
    owner = owners(key, MEMBERS, 1)[0]
    read, staged = [m for m in MEMBERS if m != owner]
    assert pooled.pools[read].store.pin(key)  # a read of its disk copy under way
    [held] = pooled.pools[staged].stage([key], "client:reader")  # a reader's staged copy
    assert held is not None
    done = pooled.rebalance(1)
    assert done[read].deferred == 1 and pooled.holders(key) == sorted([owner, read])
    assert done[staged].deferred == 1  # its disk copy went; the staged one is the reader's
    pooled.pools[read].store.unpin(key)
    pooled.pools[read].heartbeat()
    pooled.pools[staged].unstage([held])
    assert pooled.holders(key) == [owner]
    assert all(len(p.surplus) == 0 for p in pooled.pools.values())
    assert key not in pooled.pools[staged].staging
    loads_exact(pooled)


def test_a_surplus_copy_owned_again_before_its_pin_ended_stays(pooled: Pooled) -> None:
    key = pooled.keys[0]
    owner = owners(key, MEMBERS, 1)[0]
    other = next(m for m in MEMBERS if m != owner)
    pool = pooled.pools[other]
    assert pool.store.pin(key)
    assert pool.rebalance(MEMBERS, 1).deferred >= 1
    pool.rebalance(MEMBERS, 3)  # replication raised again before the pin ended: it owns it
    pool.store.unpin(key)
    pool.heartbeat()
    assert other in pooled.holders(key)


def test_a_rebalance_under_a_stale_membership_view_drops_nothing(pooled: Pooled) -> None:
    """A member leaves the pool (its actor still answers until it is stopped); the rebalance
    of the new view (generation 2) reaches the others before one of the old view (1), which
    Ray delivered late. Under the old view the leaving member owns the block, and confirms
    its copy: obeyed, the late rebalance would drop the copy the new view keeps."""
    key = pooled.keys[0]
    leaving = owners(key, MEMBERS, 1)[0]
    view = [m for m in MEMBERS if m != leaving]
    keeper = owners(key, view, 1)[0]
    for name in view:
        pooled.pools[name].rebalance(view, 1, generation=2)
    assert sorted(pooled.holders(key)) == sorted([leaving, keeper])
    late = pooled.pools[keeper].rebalance(MEMBERS, 1, generation=1)
    assert late == Rebalanced(0, 0, 0)
    assert keeper in pooled.holders(key)
    del pooled.pools[leaving]  # it goes: the new view's owner still holds the block
    targets = pooled.plane.link._targets  # type: ignore[attr-defined]
    targets.pop(actor_name("pool", leaving)).close()
    assert pooled.holders(key) == [keeper]


def test_an_owner_that_saw_a_newer_view_confirms_nothing_to_an_older_one(
        pooled: Pooled) -> None:
    key = pooled.keys[0]
    owner = owners(key, MEMBERS, 1)[0]
    other = next(m for m in MEMBERS if m != owner)
    assert pooled.pools[owner].checksums([key], generation=2) != [None]
    assert pooled.pools[owner].checksums([key], generation=1) == [None]
    pooled.pools[other].rebalance(MEMBERS, 1, generation=1)
    assert other in pooled.holders(key)  # unconfirmed: its copy stays
