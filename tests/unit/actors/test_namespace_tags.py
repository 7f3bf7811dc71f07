"""A block's namespace id travels with every copy of it: into HBM with a load, down to DRAM with
a demotion, to NVMe and to the pool, both of which keep it on disk. After the directory (and the
NVMe tier or the pool node) restart, a namespace drop still finds every copy; and the drop's
evictions from disk are durable as soon as they are made, whatever happens to the tier next."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import BLOCK, blocks, check, small_config
from tagging import NS, PoolMembers, drop, held_in, reannounce, restart_directory, start_pool

from cmx.actors.directory.shard import DirectoryShard
from cmx.actors.tiers.nvme import NvmeTierService
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.protocol import Offer
from cmx.tiers import Tier


def reopen_nvme(plane: Plane, node: str, root: str) -> NvmeTierService:
    """A new NVMe tier of ``node`` on the store directory ``root``, as after a restart."""
    cfg = plane.config
    tier = NvmeTierService(node, root, cfg.nvme_bytes, cfg.block_bytes, plane.link,
                           cfg.directory_shards, segment_bytes=cfg.nvme_segment_bytes,
                           lease_s=cfg.lease_s, clock=plane.clock)
    plane.tiers[(node, Tier.NVME)] = plane.link._targets[actor_name("nvme", node)] = tier  # type: ignore[attr-defined]
    return tier


def tagged_on_nvme(plane: Plane, node: str) -> set[BlockHash]:
    out = set()
    for shard in plane.shards:
        for key, copies in shard.namespace_blocks(NS):
            if any(c.tier is Tier.NVME and c.node == node for c in copies):
                out.add(BlockHash(key))
    return out


@pytest.mark.parametrize("placement", ["write_back", "write_through"])
def test_blocks_on_nvme_keep_their_namespace_after_the_tier_and_the_directory_restart(
    tmp_path: Path, placement: str
) -> None:
    plane = make_plane(small_config(tmp_path, placement=placement, nvme_admission_min_count=1))
    try:
        keys, payload = blocks(12, seed=5)  # DRAM holds 8: the first are demoted (write-back)
        plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload, NS)
        nvme = plane.tiers[(NODE_A, Tier.NVME)]
        on_nvme = {k for k, here in zip(keys, nvme.contains(keys)) if here}
        assert on_nvme, "nothing reached NVMe"
        root = nvme.store.root
        nvme.close()
        restart_directory(plane)
        nvme = reopen_nvme(plane, NODE_A, root)
        assert nvme.heartbeat()  # first contact: the tier resyncs the new shards
        assert tagged_on_nvme(plane, NODE_A) == on_nvme
        nvme.close()
        nvme = reopen_nvme(plane, NODE_A, root)  # the directory kept, the tier restarted
        assert nvme.heartbeat()
        assert tagged_on_nvme(plane, NODE_A) == on_nvme
        check(plane)
    finally:
        plane.close()


def test_a_drops_nvme_evictions_are_durable_before_the_tier_is_closed(tmp_path: Path) -> None:
    plane = make_plane(small_config(tmp_path, placement="write_through",
                                    nvme_admission_min_count=1))
    try:
        keys, payload = blocks(4, seed=6)
        plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload, NS)
        nvme = plane.tiers[(NODE_A, Tier.NVME)]
        assert nvme.contains(keys) == [True] * 4
        assert nvme.evict(keys[2:]) == 2
        # The files as a crash now leaves them: the tier never closes (no snapshot at close).
        crashed = str(tmp_path / "crashed")
        shutil.copytree(nvme.store.root, crashed)
        again = reopen_nvme(plane, NODE_A, crashed)
        assert again.contains(keys) == [True, True, False, False]
        again.check_integrity()
    finally:
        plane.close()


def test_a_drop_while_restarted_shards_learn_their_sources_is_not_reported_done(
    tmp_path: Path
) -> None:
    """Restarted shards know no copy until each tier's heartbeat makes it resync them: a drop
    before then would find nothing and report success, the copies all kept."""
    plane = make_plane(small_config(tmp_path))
    try:
        keys, payload = blocks(4, seed=12)
        plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload, NS)
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        cfg = plane.config
        for i in range(len(plane.shards)):  # as the controller starts a lost shard again
            plane.shards[i] = plane.link._targets[actor_name("dir", i)] = \
                DirectoryShard(i, cfg.heartbeat_s, cfg.resync_s, plane.clock)  # type: ignore[attr-defined]
        with pytest.raises(UnavailableError, match="not dropped whole"):
            drop(plane)
        assert dram.contains(keys) == [True] * 4
        reannounce(plane)  # every tier resyncs; another source could still be on its way
        with pytest.raises(UnavailableError, match="still learning"):
            drop(plane)
        plane.clock.advance(2 * cfg.heartbeat_s)  # every source has been in touch
        assert drop(plane) == 4
        assert dram.contains(keys) == [False] * 4 and held_in(plane, keys) == set()
        check(plane)
    finally:
        plane.close()


# -- copies in HBM and in the pool -------------------------------------------------------------


@pytest.mark.parametrize("how", ["load", "prefetch", "load from a peer"])
def test_a_drop_after_the_directory_restarts_removes_copies_held_only_in_hbm(
    tmp_path: Path, how: str
) -> None:
    plane = make_plane(small_config(tmp_path))
    try:
        keys, payload = blocks(2, seed=7)
        plane.agents[NODE_A].store(keys, [None, keys[0]], payload, NS)
        node = NODE_B if how == "load from a peer" else NODE_A
        agent = plane.agents[node]
        if how == "prefetch":
            assert agent.prefetch(keys, plane.lookup(keys), namespace=NS) == 2
        else:
            loaded = agent.load(keys, plane.lookup(keys), namespace=NS).blocks
            assert len(loaded) == 2
            agent.release([b.lease for b in loaded])
        assert plane.tiers[(NODE_A, Tier.DRAM)].evict(keys) == 2
        hbm = plane.tiers[(node, Tier.HBM)]
        assert held_in(plane, keys) == {Tier.HBM} and hbm.contains(keys) == [True, True]
        restart_directory(plane)
        reannounce(plane)
        assert drop(plane) == 2
        assert hbm.contains(keys) == [False, False]
        assert held_in(plane, keys) == set()
        check(plane)
    finally:
        plane.close()


def test_hbm_copies_demoted_to_dram_keep_their_namespace(tmp_path: Path) -> None:
    plane = make_plane(small_config(tmp_path))
    try:
        keys, payload = blocks(6, seed=8)
        agent = plane.agents[NODE_A]
        agent.store(keys[:2], [None, keys[0]], payload[: 2 * BLOCK], NS)
        loaded = agent.load(keys[:2], plane.lookup(keys[:2]), namespace=NS).blocks
        agent.release([b.lease for b in loaded])
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        assert dram.evict(keys[:2]) == 2  # only HBM holds them now
        others = keys[2:]
        agent.store(others, [None, *others[:-1]], payload[2 * BLOCK :])
        agent.release([b.lease for b in agent.load(others, plane.lookup(others)).blocks])
        assert dram.contains(keys[:2]) == [True, True]  # HBM (4 slots) demoted them
        assert held_in(plane, keys[:2]) == {Tier.DRAM}
        restart_directory(plane)
        reannounce(plane)
        assert drop(plane) == 2
        assert dram.contains(keys[:2]) == [False, False]
        check(plane)
    finally:
        plane.close()


@pytest.mark.parametrize("pool_restarts", [False, True])
def test_a_drop_after_the_directory_restarts_removes_copies_held_only_in_the_pool(
    tmp_path: Path, pool_restarts: bool
) -> None:
    plane = make_plane(small_config(tmp_path, pool_admission_min_count=1))
    plane.link._targets["cmx:controller"] = PoolMembers(["pool-1"])  # type: ignore[attr-defined]
    pool = start_pool(plane, "pool-1")
    try:
        keys, payload = blocks(3, seed=9)
        plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload, NS)
        assert pool.contains(keys) == [True] * 3
        assert plane.tiers[(NODE_A, Tier.DRAM)].evict(keys) == 3
        assert held_in(plane, keys) == {Tier.POOL}
        restart_directory(plane)
        if pool_restarts:  # the tags come back from the pool node's disk
            pool.close()
            pool = start_pool(plane, "pool-1")
        reannounce(plane, pool)
        assert drop(plane) == 3
        assert pool.contains(keys) == [False] * 3
        pool.check_integrity()
        check(plane)
    finally:
        pool.close()
        plane.close()


def test_a_drops_pool_evictions_are_durable_before_the_pool_node_is_closed(
    tmp_path: Path
) -> None:
    plane = make_plane(small_config(tmp_path, pool_admission_min_count=1))
    plane.link._targets["cmx:controller"] = PoolMembers(["pool-1"])  # type: ignore[attr-defined]
    pool = start_pool(plane, "pool-1")
    try:
        keys, payload = blocks(4, seed=10)
        plane.agents[NODE_A].store(keys, [None, *keys[:-1]], payload, NS)
        assert pool.evict(keys[2:]) == 2
        # The files as a crash now leaves them: the node never closes (no snapshot at close).
        crashed = str(tmp_path / "crashed")
        shutil.copytree(pool.store.root, crashed)
        again = start_pool(plane, "pool-1", crashed)
        try:
            assert again.contains(keys) == [True, True, False, False]
            again.check_integrity()
        finally:
            again.close()
    finally:
        pool.close()
        plane.close()


def test_an_offer_with_a_tag_too_long_to_keep_is_refused_before_anything_is_held(
    tmp_path: Path
) -> None:
    plane = make_plane(small_config(tmp_path))
    pool = start_pool(plane, "pool-1")
    try:
        keys, payload = blocks(2, seed=11)
        source = plane.agents[NODE_A]
        source.store(keys, [None, keys[0]], payload, NS)
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        pins = dram.pin(keys, source.owner)
        region = source.tiers.current(Tier.DRAM)[0].arena
        offers = [Offer(p.key, None, region, p.slot, p.size, p.checksum, tag)
                  for p, tag in zip(pins, [NS, "x" * 4096]) if p is not None]
        with pytest.raises(ValueError, match="tag"):
            pool.ingest(actor_name("agent", NODE_A), offers)
        dram.unpin([p.lease for p in pins if p is not None])
        assert pool.contains(keys) == [False, False]
        assert (pool.stats().pinned, pool.stats().reserved) == (0, 0)
        pool.check_integrity()
        check(plane)
    finally:
        pool.close()
        plane.close()
