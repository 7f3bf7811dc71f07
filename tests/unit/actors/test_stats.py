"""Typed stats follow what happens: pins, reservations and leases of a tier, what an agent moved
and found corrupt, the directory's counts; a part that does not answer is ``Unreachable``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import BLOCK, LEASE_S, blocks, check, load, small_config

from cmx.links import actor_name
from cmx.stats import (
    AgentStats,
    DirectoryStats,
    LeaseStats,
    NodeStats,
    PoolStats,
    ServiceStats,
    TierStats,
    Unreachable,
    collect,
)
from cmx.storage.base import StoreStats
from cmx.tiers import Tier


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path))
    yield p
    p.close()


class Controller:
    """The two questions ``collect`` asks the controller, answered for the plane's nodes."""

    def __init__(self, nodes: list[str], pool: list[str]) -> None:
        self._nodes, self._pool = nodes, pool

    def nodes(self) -> list[str]:
        return self._nodes

    def pool_members(self) -> list[str]:
        return self._pool


def tier(plane: Plane, node: str, kind: Tier) -> TierStats:
    stats = plane.tiers[(node, kind)].stats()
    assert isinstance(stats, TierStats)
    return stats


def test_a_memory_tier_counts_pins_reservations_and_leases_as_they_come_and_go(
    plane: Plane,
) -> None:
    keys, payload = blocks(5, seed=71)
    assert plane.agents[NODE_A].store(keys[:3], [None, *keys[:2]], payload[: 3 * BLOCK]) == 3
    dram = plane.tiers[(NODE_A, Tier.DRAM)]
    s = tier(plane, NODE_A, Tier.DRAM)
    assert (s.tier, s.node, s.blocks, s.pinned, s.reserved) == (Tier.DRAM, NODE_A, 3, 0, 0)
    assert (s.capacity_bytes, s.leases) == (8 * BLOCK, LeaseStats(0, 0, 0, 0))

    pins = dram.pin(keys[:2], owner="client:a")
    s = tier(plane, NODE_A, Tier.DRAM)
    assert (s.pinned, s.leases.pinned) == (2, 2)
    dram.unpin([p.lease for p in pins])
    assert (tier(plane, NODE_A, Tier.DRAM).pinned,
            tier(plane, NODE_A, Tier.DRAM).leases.pinned) == (0, 0)

    grants = dram.reserve([(k, None) for k in keys[3:]], "client:gone")
    s = tier(plane, NODE_A, Tier.DRAM)
    assert all(grants) and (s.reserved, s.leases.reserved) == (2, 2)
    assert s.used_bytes == 5 * BLOCK  # reserved slots count as used
    plane.clock.advance(LEASE_S)
    dram.heartbeat()
    s = tier(plane, NODE_A, Tier.DRAM)
    assert (s.reserved, s.leases.reserved, s.leases.expired) == (0, 0, 2)
    assert s.used_bytes == 3 * BLOCK

    dram.pin(keys[:1], owner="client:b")
    assert dram.release_owner("client:b") == 1
    s = tier(plane, NODE_A, Tier.DRAM)
    assert (s.pinned, s.leases.released) == (0, 1)
    check(plane)


def test_an_nvme_tier_counts_its_reserved_extents_and_their_expiry(plane: Plane) -> None:
    keys, _ = blocks(2, seed=72)
    nvme = plane.tiers[(NODE_A, Tier.NVME)]
    extents = nvme.reserve([(k, None, BLOCK) for k in keys], "agent:gone")
    s = tier(plane, NODE_A, Tier.NVME)
    assert all(extents) and (s.tier, s.reserved, s.leases.reserved) == (Tier.NVME, 2, 2)
    plane.clock.advance(LEASE_S)
    nvme.heartbeat()
    s = tier(plane, NODE_A, Tier.NVME)
    assert (s.reserved, s.leases.expired, s.blocks) == (0, 2, 0)
    check(plane)


def test_an_agent_counts_what_it_stored_loaded_promoted_and_demoted(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(10, seed=73)
    before = agent.stats()
    assert (before.stores, before.loads, before.promoted_bytes, before.demoted_bytes) == (0, 0,
                                                                                         0, 0)
    assert agent.store(keys, [None, *keys[:-1]], payload) == 10  # DRAM holds 8: two demoted
    data, loaded = load(plane, NODE_A, keys[-2:])  # the last two are still in DRAM
    assert np.array_equal(data, payload[8 * BLOCK:])
    s = agent.stats()
    assert isinstance(s, AgentStats)
    assert (s.agent, s.node, s.placed_on, s.dpu) == (agent.name, NODE_A, NODE_A, False)
    assert (s.stores, s.loads) == (3, 1)  # a store commits in windows of half of DRAM
    assert s.moved_bytes["client->dram"] == 10 * BLOCK
    assert s.promoted_bytes == s.moved_bytes["dram->hbm"] == 2 * BLOCK
    assert s.demoted_bytes == s.moved_bytes["dram->nvme"] >= 2 * BLOCK
    assert s.queues.done["load"] >= 1 and s.queues.queued["load"] == 0
    assert s.verify_failures == 0 and s.plane.blocks_written >= 2
    check(plane)


def test_an_agent_counts_the_copies_found_corrupt_where_they_were_found(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(12, seed=74)
    agent.store(keys, [None, *keys[:-1]], payload)
    nvme = plane.tiers[(NODE_A, Tier.NVME)]
    victim = next(k for k in keys if k in nvme.store
                  and k not in plane.tiers[(NODE_A, Tier.DRAM)].store)
    entry = nvme.store.entry_of(victim)
    with open(nvme.store.segment_path(entry.seg), "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    i = keys.index(victim)
    assert load(plane, NODE_A, keys[i : i + 1])[1] == []
    s = agent.stats()
    assert dict(s.corrupt_blocks) == {"nvme": 1} and s.verify_failures == 1
    assert tier(plane, NODE_A, Tier.NVME).store.quarantined == 1

    last = keys[-1]  # in DRAM; the caller of a load says its bytes were wrong
    result = agent.load([last], plane.lookup([last]))
    agent.release([b.lease for b in result.blocks], corrupt=result.blocks)
    assert agent.stats().corrupt_blocks == {"nvme": 1, "consumer": 1}
    assert tier(plane, NODE_A, Tier.DRAM).store.quarantined == 1
    check(plane)


def test_the_service_stats_show_a_tier_that_does_not_answer_as_unreachable(
    plane: Plane,
) -> None:
    keys, payload = blocks(3, seed=75)
    plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload)
    targets = plane.link._targets  # type: ignore[attr-defined]
    targets["cmx:controller"] = Controller([NODE_A, NODE_B], ["pool-x"])
    del targets[actor_name("dram", NODE_B)]  # it died: every call to it fails

    stats = collect(plane.link, shards=2, replication=2)
    assert isinstance(stats, ServiceStats) and set(stats.nodes) == {NODE_A, NODE_B}
    b = stats.nodes[NODE_B]
    assert isinstance(b, NodeStats) and isinstance(b.agent, AgentStats)
    down = b.tiers[Tier.DRAM]
    assert isinstance(down, Unreachable) and "dram" in down.reason
    assert isinstance(b.tiers[Tier.HBM], TierStats) and isinstance(b.tiers[Tier.NVME], TierStats)
    a = stats.nodes[NODE_A]
    assert all(isinstance(t, TierStats) for t in a.tiers.values())
    dram_a = a.tiers[Tier.DRAM]
    assert isinstance(dram_a, TierStats) and dram_a.blocks == 3

    assert all(isinstance(d, DirectoryStats) for d in stats.directory)
    shards = [d for d in stats.directory if isinstance(d, DirectoryStats)]
    assert [d.shard for d in shards] == [0, 1]
    assert sum(d.blocks for d in shards) == sum(d.copies for d in shards) == 3
    assert isinstance(stats.pool.members["pool-x"], Unreachable)  # no such pool node runs
    assert (stats.pool.capacity_bytes, stats.pool.replication) == (0, 2)


def test_a_part_whose_stats_fail_is_unreachable_with_why(plane: Plane) -> None:
    def broken() -> TierStats:
        raise RuntimeError("arena unmapped")

    plane.tiers[(NODE_A, Tier.HBM)].stats = broken
    plane.link._targets["cmx:controller"] = Controller([NODE_A], [])  # type: ignore[attr-defined]
    hbm = collect(plane.link, shards=2, replication=1).nodes[NODE_A].tiers[Tier.HBM]
    assert isinstance(hbm, Unreachable) and "arena unmapped" in hbm.reason


def test_the_pool_sums_the_members_that_answered() -> None:
    store = StoreStats(100 * BLOCK, 40 * BLOCK, 40)
    member = TierStats(Tier.POOL, "p1", "e", store, 0, 0, LeaseStats(0, 0, 0, 0))
    pool = PoolStats({"p1": member, "p2": Unreachable("gone"), "p3": member}, 2, 40, 40)
    assert (pool.capacity_bytes, pool.used_bytes) == (200 * BLOCK, 80 * BLOCK)
