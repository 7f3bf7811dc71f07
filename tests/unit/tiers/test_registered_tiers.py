"""A tier registered by the test suite alone (``specs``: CXL memory, a disk below NVMe) goes
where the four built in go: the plane builds its books, lookups find its blocks and
``best_copy`` ranks them by its rank, the agent loads them into HBM with their exact bytes, from
its own node and from another, a client finds and loads them, and the stats list it. Nothing
outside this folder names either tier."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch
from plane import NODE_A, NODE_B, Plane, make_plane, namespace_client
from scenarios import BLOCK, LAYOUT, blocks, check, load, small_config
from specs import CXL, HDD

from cmx.actors.tiers.arena import ArenaTierService
from cmx.actors.tiers.nvme import NvmeTierService
from cmx.checksum import checksum
from cmx.doors import TierStatsOf
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.policies.breakeven import BreakEven, source_class
from cmx.protocol import best_copy
from cmx.stats import collect
from cmx.tiers import (
    Holds,
    Tier,
    node_tiers,
    register_tier,
    tier_specs,
    unregister_tier,
)


@pytest.fixture
def plane(tmp_path, registered) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path))
    yield p
    p.close()


def parents(keys: Sequence[BlockHash]) -> list[BlockHash | None]:
    return [None, *keys[:-1]]


def put_in_memory(plane: Plane, node: str, tier: Tier, keys: list[BlockHash],
                  payload: np.ndarray, namespace: str = "") -> None:
    """Blocks into ``node``'s memory ``tier`` as a writer puts them there: reserve, copy into
    the granted slots (the agent's mapping of the tier's arena), commit."""
    books = plane.tiers[(node, tier)]
    arenas = plane.agents[node].tiers
    items = []
    for i, grant in enumerate(books.reserve(list(zip(keys, parents(keys))), "test")):
        assert grant is not None
        data = payload[i * BLOCK:(i + 1) * BLOCK]
        arenas.arena(grant.epoch).slot_view(grant.slot)[:BLOCK] = data
        items.append((grant.lease, BLOCK, checksum(data)))
    assert books.commit(items, namespace) == len(keys)


def put_on_disk(plane: Plane, node: str, tier: Tier, keys: list[BlockHash],
                payload: np.ndarray, namespace: str = "") -> None:
    """Blocks onto ``node``'s extents ``tier``: reserve, the agent's I/O writes, commit."""
    books = plane.tiers[(node, tier)]
    extents = books.reserve([(k, p, BLOCK, namespace) for k, p in zip(keys, parents(keys))],
                            "test")
    assert all(e is not None for e in extents)
    sums = plane.agents[node].host.write_extents(
        extents, [payload[i * BLOCK:(i + 1) * BLOCK] for i in range(len(keys))])
    done = [(e.lease, e.size, c, chunks) for e, (c, chunks) in zip(extents, sums)]
    assert books.commit(done) == len(keys)


def on_both_test_tiers(plane: Plane, registered: tuple[Tier, Tier], seed: int
                       ) -> tuple[list[BlockHash], np.ndarray]:
    """Four blocks on node A: the first two in the memory tier, the last two on the disk."""
    cxl, hdd = registered
    keys, payload = blocks(4, seed=seed)
    put_in_memory(plane, NODE_A, cxl, keys[:2], payload[:2 * BLOCK])
    put_on_disk(plane, NODE_A, hdd, keys[2:], payload[2 * BLOCK:])
    return keys, payload


def nothing_held(plane: Plane, tiers: Sequence[Tier]) -> bool:
    return all((s.pinned, s.reserved) == (0, 0)
               for s in (plane.tiers[(n, t)].stats() for n in (NODE_A, NODE_B) for t in tiers))


def test_a_registered_tier_takes_its_place_by_its_rank(registered: tuple[Tier, Tier]) -> None:
    cxl, hdd = registered
    assert [s.name for s in tier_specs()] == ["hbm", "dram", "cxl", "nvme", "hdd", "pool"]
    assert Tier("cxl") is cxl and cxl.spec is CXL and (cxl.rank, hdd.rank) == (1.5, 2.5)
    assert list(Tier) == [Tier.HBM, Tier.DRAM, cxl, Tier.NVME, hdd, Tier.POOL]
    assert node_tiers() == (Tier.HBM, Tier.DRAM, cxl, Tier.NVME, hdd)
    assert node_tiers(Holds.MEMORY) == (Tier.HBM, Tier.DRAM, cxl)
    assert pickle.loads(pickle.dumps(cxl)) is cxl  # as it crosses between actors
    with pytest.raises(ValueError, match="registered already"):
        register_tier(replace(CXL, link_here=(1.0, 1.0)))
    with pytest.raises(ValueError, match="rank"):
        register_tier(replace(CXL, name="cxl2"))
    with pytest.raises(ValueError, match="folder"):
        register_tier(replace(HDD, name="tape", rank=2.75, files=None))


def test_a_tier_let_go_of_is_no_tier_and_the_four_stay() -> None:
    scratch = register_tier(replace(CXL, name="scratch", rank=1.25))
    unregister_tier(scratch)
    with pytest.raises(ValueError, match="not a registered tier"):
        Tier("scratch")
    assert [s.name for s in tier_specs()] == ["hbm", "dram", "nvme", "pool"]
    with pytest.raises(ValueError, match="built-in"):
        unregister_tier("dram")


def test_the_plane_builds_each_registered_tier_as_the_books_of_its_kind(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    cxl, hdd = registered
    config = plane.config
    for node in (NODE_A, NODE_B):
        memory, disk = plane.tiers[(node, cxl)], plane.tiers[(node, hdd)]
        assert isinstance(memory, ArenaTierService) and isinstance(disk, NvmeTierService)
        for tier, books in ((cxl, memory), (hdd, disk)):  # served under its own actor name
            answer = plane.link.call(actor_name(tier.value, node), TierStatsOf())
            assert (answer.tier, answer.epoch) == (tier, books.epoch)
        assert memory.stats().capacity_bytes == 2 * config.dram_bytes
        assert disk.stats().capacity_bytes == 4 * config.nvme_bytes
        assert disk.store.root == os.path.join(config.nvme_dir, "hdd", node)
        info, _ = plane.agents[node].tiers.current(cxl)  # the agent mapped the CXL arena
        assert info.tier is cxl and info.num_slots == 2 * config.dram_bytes // BLOCK


def test_lookups_find_the_blocks_of_the_test_tiers_and_rank_them_by_their_rank(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    cxl, hdd = registered
    keys, payload = blocks(4, seed=1)
    put_in_memory(plane, NODE_A, cxl, keys[:2], payload[:2 * BLOCK])
    put_on_disk(plane, NODE_A, Tier.NVME, keys[1:3], payload[BLOCK:3 * BLOCK])
    put_on_disk(plane, NODE_A, hdd, keys[2:], payload[2 * BLOCK:])
    copies = plane.lookup(keys)
    assert [sorted(c.tier.value for c in cs) for cs in copies] == [
        ["cxl"], ["cxl", "nvme"], ["hdd", "nvme"], ["hdd"]]
    # CXL before NVMe, NVMe before the disk below it: seen from either node.
    for node in (NODE_A, NODE_B):
        assert [best_copy(cs, node).tier for cs in copies] == [cxl, cxl, Tier.NVME, hdd]
    put_on_disk(plane, NODE_B, hdd, keys[:1], payload[:BLOCK])
    assert best_copy(plane.lookup(keys[:1])[0], NODE_B).node == NODE_B  # its own node first
    check(plane)


def test_the_agent_loads_the_test_tiers_blocks_into_hbm_exact(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    cxl, hdd = registered
    keys, payload = on_both_test_tiers(plane, registered, seed=2)
    data, loaded = load(plane, NODE_A, keys)
    assert np.array_equal(data, payload)
    assert [b.source_tier for b in loaded] == [cxl, cxl, hdd, hdd]
    moved = plane.agents[NODE_A].counters.moved
    assert (moved["cxl->hbm"], moved["hdd->hbm"]) == (2 * BLOCK, 2 * BLOCK)
    assert nothing_held(plane, registered)
    check(plane)


def test_another_node_loads_them_from_the_peer_exact(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    cxl, hdd = registered
    keys, payload = on_both_test_tiers(plane, registered, seed=3)
    data, loaded = load(plane, NODE_B, keys)
    assert np.array_equal(data, payload)
    assert [b.source_tier for b in loaded] == [cxl, cxl, hdd, hdd]
    assert {b.source_node for b in loaded} == {NODE_A}
    assert plane.agents[NODE_A].counters.moved["hdd->dram"] == 2 * BLOCK  # staged via DRAM
    assert plane.agents[NODE_B].counters.moved["cxl@peer->hbm"] == 2 * BLOCK
    assert nothing_held(plane, registered)
    check(plane)


def test_a_corrupt_block_on_the_disk_tier_is_a_miss_and_quarantined_there(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    _, hdd = registered
    keys, payload = blocks(2, seed=4)
    put_on_disk(plane, NODE_A, hdd, keys, payload)
    disk = plane.tiers[(NODE_A, hdd)]
    entry = disk.store.entry_of(keys[1])
    with open(disk.store.segment_path(entry.seg), "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    data, loaded = load(plane, NODE_A, keys)
    assert len(loaded) == 1 and np.array_equal(data, payload[:BLOCK])
    assert disk.stats().store.quarantined == 1 and keys[1] not in disk.store
    assert plane.agents[NODE_A].counters.corrupt["hdd"] == 1
    assert plane.lookup(keys[1:]) == [[]]
    check(plane)


def test_a_client_finds_and_loads_the_test_tiers_blocks(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    cxl, hdd = registered
    ns = namespace_client(plane, NODE_A, LAYOUT, "t")
    T = LAYOUT.block_tokens
    toks = np.random.default_rng(5).integers(0, 50_000, 3 * T)
    kv = LAYOUT.random_kv(len(toks), seed=5)
    keys = ns.keys(toks)
    payload = torch.cat(LAYOUT.split_blocks(kv)).numpy()
    put_in_memory(plane, NODE_A, cxl, keys[:2], payload[:2 * BLOCK], ns.namespace.id)
    put_on_disk(plane, NODE_A, hdd, keys[2:], payload[2 * BLOCK:], ns.namespace.id)
    match = ns.lookup(toks)
    assert [b.tier for b in match.blocks] == [cxl, cxl, hdd]
    assert torch.equal(ns.load(toks), kv)
    # Break-even reads a load from the CXL tier here by the tier's own prior.
    gate = BreakEven()
    assert gate.link(source_class(cxl.value, NODE_A, NODE_A)).snapshot() == CXL.link_here
    assert gate.link(source_class(hdd.value, NODE_B, NODE_A)).snapshot() == HDD.link_peer
    assert nothing_held(plane, (*registered, Tier.HBM))
    check(plane)


class Controller:
    def __init__(self, nodes: list[str]) -> None:
        self._nodes = nodes

    def nodes(self) -> list[str]:
        return self._nodes

    def pool_members(self) -> list[str]:
        return []


def test_the_stats_gather_the_test_tiers_of_every_node(
    plane: Plane, registered: tuple[Tier, Tier],
) -> None:
    cxl, hdd = registered
    keys, payload = blocks(2, seed=6)
    put_in_memory(plane, NODE_A, cxl, keys, payload)
    plane.link._targets["cmx:controller"] = Controller([NODE_A, NODE_B])  # type: ignore[attr-defined]
    stats = collect(plane.link, shards=2, replication=1)
    for node in (NODE_A, NODE_B):
        assert list(stats.nodes[node].tiers) == [Tier.HBM, Tier.DRAM, cxl, Tier.NVME, hdd]
    assert stats.nodes[NODE_A].tiers[cxl].blocks == 2  # type: ignore[union-attr]
