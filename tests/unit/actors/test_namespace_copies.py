"""The copies a node makes on its own keep the namespace of the copy they were made from: a DRAM
copy an agent promotes from its NVMe for a peer, an HBM copy a load or prefetch makes when its
caller names no namespace, and a pool copy held untagged when a tagged offer of it comes (the
pool node adopts the tag on disk, its bytes untouched). After the directory (and the pool
node) restart, a namespace drop still finds each such copy and removes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import blocks, check, small_config
from tagging import NS, PoolMembers, drop, held_in, reannounce, restart_directory, start_pool

from cmx.actors.pool.node import PoolNodeService
from cmx.actors.tiers.nvme import extent_tag
from cmx.keys import BlockHash
from cmx.protocol import Offer
from cmx.tiers import Tier


def evict_all_but(plane: Plane, keys: list[BlockHash], node: str, tier: Tier,
                  *pools: PoolNodeService) -> None:
    """Drop every copy of ``keys`` but those in ``tier`` of ``node``: they become the only."""
    for (n, t), svc in plane.tiers.items():
        if (n, t) != (node, tier):
            svc.evict(keys)
    for pool in pools:
        pool.evict(keys)


def test_a_dram_copy_promoted_from_nvme_for_a_peer_keeps_the_namespace(tmp_path: Path) -> None:
    plane = make_plane(small_config(tmp_path, placement="write_through",
                                    nvme_admission_min_count=1))
    try:
        keys, payload = blocks(2, seed=21)
        plane.agents[NODE_A].store(keys, [None, keys[0]], payload, NS)
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        assert dram.evict(keys) == 2  # only node-a's NVMe holds them
        reader = plane.agents[NODE_B]
        loaded = reader.load(keys, plane.lookup(keys), namespace=NS).blocks
        assert [(b.source_tier, b.source_node) for b in loaded] == [(Tier.NVME, NODE_A)] * 2
        reader.release([b.lease for b in loaded])
        assert dram.contains(keys) == [True, True]  # promoted there for the peer
        evict_all_but(plane, keys, NODE_A, Tier.DRAM)
        assert held_in(plane, keys) == {Tier.DRAM}
        restart_directory(plane)
        reannounce(plane)
        assert drop(plane) == 2
        assert dram.contains(keys) == [False, False]
        check(plane)
    finally:
        plane.close()


SOURCES = [  # (where the block is read from, how the HBM copy is made)
    ("this node's DRAM", "load"), ("this node's DRAM", "prefetch"), ("this node's NVMe", "load"),
    ("a peer's DRAM", "load"), ("a peer's NVMe", "load"), ("the pool", "load"),
]


@pytest.mark.parametrize(("source", "how"), SOURCES)
def test_an_hbm_copy_made_without_a_namespace_takes_the_tag_of_its_source(
    tmp_path: Path, source: str, how: str
) -> None:
    tier = {"DRAM": Tier.DRAM, "NVMe": Tier.NVME}.get(source.split()[-1], Tier.POOL)
    plane = make_plane(small_config(tmp_path, placement="write_through",
                                    nvme_admission_min_count=1, pool_admission_min_count=1))
    pools = []
    if tier is Tier.POOL:  # elsewhere no pool: a load writes nothing to one behind the test
        plane.link._targets["cmx:controller"] = PoolMembers(["pool-1"])  # type: ignore[attr-defined]
        pools.append(start_pool(plane, "pool-1"))
    try:
        keys, payload = blocks(2, seed=22)
        plane.agents[NODE_A].store(keys, [None, keys[0]], payload, NS)
        evict_all_but(plane, keys, NODE_A, tier)
        assert held_in(plane, keys) == {tier}
        node = NODE_A if source.startswith("this node") else NODE_B
        agent = plane.agents[node]
        if how == "prefetch":  # the caller names no namespace: the source's tag goes along
            assert agent.prefetch(keys, plane.lookup(keys)) == 2
        else:
            loaded = agent.load(keys, plane.lookup(keys)).blocks
            assert [b.source_tier for b in loaded] == [tier] * 2
            agent.release([b.lease for b in loaded])
        hbm = plane.tiers[(node, Tier.HBM)]
        evict_all_but(plane, keys, node, Tier.HBM, *pools)
        assert held_in(plane, keys) == {Tier.HBM} and hbm.contains(keys) == [True, True]
        restart_directory(plane)
        reannounce(plane, *pools)
        assert drop(plane) == 2
        assert hbm.contains(keys) == [False, False]
        check(plane)
    finally:
        for pool in pools:
            pool.close()
        plane.close()


@pytest.mark.parametrize("after", ["the directory restarts", "the pool node restarts",
                                   "the pool node crashes"])
def test_a_pool_copy_held_untagged_adopts_the_namespace_of_a_later_offer(
    tmp_path: Path, after: str
) -> None:
    plane = make_plane(small_config(tmp_path, pool_admission_min_count=1))
    plane.link._targets["cmx:controller"] = PoolMembers(["pool-1"])  # type: ignore[attr-defined]
    pool = start_pool(plane, "pool-1")
    try:
        keys, payload = blocks(3, seed=23)
        agent = plane.agents[NODE_A]
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        agent.store(keys, [None, *keys[:-1]], payload)  # no namespace: the pool's copies none
        assert [extent_tag(pool.store, k) for k in keys] == [""] * 3
        written = pool.store.stats().bytes_written
        assert dram.evict(keys) == 3
        agent.store(keys, [None, *keys[:-1]], payload, NS)  # offered again, with its namespace
        assert [extent_tag(pool.store, k) for k in keys] == [NS] * 3
        assert pool.store.stats().bytes_written == written  # the tag, not the bytes, again
        crashed = str(tmp_path / "crashed")
        shutil.copytree(pool.store.root, crashed)  # the files as a crash now leaves them
        assert dram.evict(keys) == 3
        assert held_in(plane, keys) == {Tier.POOL}
        restart_directory(plane)
        if after != "the directory restarts":
            pool.close()
            pool = start_pool(plane, "pool-1", crashed if "crashes" in after else "")
        reannounce(plane, pool)
        assert drop(plane) == 3
        assert pool.contains(keys) == [False] * 3
        pool.check_integrity()
        check(plane)
    finally:
        pool.close()
        plane.close()


def test_an_offer_with_a_bad_tag_adopts_nothing_for_blocks_the_pool_holds(
    tmp_path: Path
) -> None:
    plane = make_plane(small_config(tmp_path, pool_admission_min_count=1))
    plane.link._targets["cmx:controller"] = PoolMembers(["pool-1"])  # type: ignore[attr-defined]
    pool = start_pool(plane, "pool-1")
    try:
        keys, payload = blocks(2, seed=24)
        source = plane.agents[NODE_A]
        source.store(keys, [None, keys[0]], payload)  # untagged, in DRAM and the pool
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        pins = dram.pin(keys, source.owner)
        region = source.tiers.current(Tier.DRAM)[0].arena
        offers = [Offer(p.key, None, region, p.slot, p.size, p.checksum, tag)
                  for p, tag in zip(pins, [NS, "x" * 4096]) if p is not None]
        with pytest.raises(ValueError, match="tag"):
            pool.ingest("cmx:agent:node-a", offers)
        dram.unpin([p.lease for p in pins if p is not None])
        assert [extent_tag(pool.store, k) for k in keys] == ["", ""]
        assert (pool.stats().pinned, pool.stats().reserved) == (0, 0)
        pool.check_integrity()
        check(plane)
    finally:
        pool.close()
        plane.close()
