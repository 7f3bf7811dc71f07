"""The data plane in one process: stores, demotion down the tiers, loads from every source."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from plane import NODE_A, NODE_B, LaggingLink, Plane, make_plane

from cmx.config import ServiceConfig
from cmx.keys import Namespace, chain_keys
from cmx.layout import KVLayout
from cmx.tiers import Tier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
BLOCK = LAYOUT.block_bytes  # 8 KiB


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    config = ServiceConfig(
        block_bytes=BLOCK, hbm_bytes=4 * BLOCK, dram_bytes=8 * BLOCK, nvme_bytes=256 * BLOCK,
        nvme_dir=str(tmp_path), nvme_segment_bytes=16 * BLOCK, directory_shards=2,
    )
    p = make_plane(config)
    yield p
    p.close()


def blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 1000, n * LAYOUT.block_tokens)
    keys = chain_keys(Namespace("m", LAYOUT).digest, toks, LAYOUT.block_tokens)
    return keys, rng.integers(0, 256, n * BLOCK, dtype=np.uint8)


def store(plane: Plane, node: str, keys: list[bytes], payload: np.ndarray) -> int:
    return plane.agents[node].store(keys, [None, *keys[:-1]], payload)


def load(plane: Plane, node: str, keys: list[bytes]) -> tuple[np.ndarray, list]:
    agent = plane.agents[node]
    result = agent.load(keys, plane.lookup(keys))
    _, hbm = agent.tiers.current(Tier.HBM)
    data = np.concatenate(
        [hbm.slot_view(b.slot)[: b.size] for b in result.blocks]
        or [np.empty(0, np.uint8)]
    ).copy()
    agent.release([b.lease for b in result.blocks])
    return data, result.blocks


def check(plane: Plane) -> None:
    for tier in plane.tiers.values():
        tier.check_integrity()
    for shard in plane.shards:
        shard.check_integrity()


def test_store_then_load_locally_from_dram(plane: Plane) -> None:
    keys, payload = blocks(3, seed=1)
    assert store(plane, NODE_A, keys, payload) == 3
    assert all(c and c[0].tier is Tier.DRAM for c in plane.lookup(keys))
    data, loaded = load(plane, NODE_A, keys)
    assert np.array_equal(data, payload)
    assert {b.source_tier for b in loaded} == {Tier.DRAM}
    data, loaded = load(plane, NODE_A, keys)  # now a hit in HBM
    assert {b.source_tier for b in loaded} == {Tier.HBM}
    for tier in (Tier.HBM, Tier.DRAM):  # pins taken ahead and not used went back too
        stats = plane.tiers[(NODE_A, tier)].stats()
        assert (stats.pinned, stats.reserved) == (0, 0), tier
    check(plane)


def test_dram_overflow_demotes_to_nvme_and_everything_loads(plane: Plane) -> None:
    keys, payload = blocks(20, seed=2)  # DRAM holds 8
    assert store(plane, NODE_A, keys, payload) == 20
    tiers = [{c.tier for c in copies} for copies in plane.lookup(keys)]
    assert all(t for t in tiers)
    assert sum(Tier.NVME in t for t in tiers) >= 12
    data = np.concatenate([load(plane, NODE_A, keys[i : i + 2])[0] for i in range(0, 20, 2)])
    assert np.array_equal(data, payload)
    moved = plane.agents[NODE_A].counters.moved
    assert moved["dram->nvme"] >= 12 * BLOCK and moved["nvme->hbm"] > 0
    check(plane)


def test_load_from_the_other_node_over_the_transport(plane: Plane) -> None:
    keys, payload = blocks(12, seed=3)  # some in B's DRAM, some demoted to B's NVMe
    store(plane, NODE_B, keys, payload)
    got = []
    for i in range(0, 12, 3):
        data, loaded = load(plane, NODE_A, keys[i : i + 3])
        assert {b.source_node for b in loaded} == {NODE_B}
        got.append(data)
    assert np.array_equal(np.concatenate(got), payload)
    agent = plane.agents[NODE_A]
    assert agent.counters.moved_via[agent.transport.name] == 12 * BLOCK
    assert plane.agents[NODE_B].counters.moved["nvme->dram"] > 0  # NVMe blocks were staged
    check(plane)


def test_corrupt_nvme_block_is_a_miss_and_quarantined(plane: Plane) -> None:
    keys, payload = blocks(12, seed=4)
    store(plane, NODE_A, keys, payload)
    nvme = plane.tiers[(NODE_A, Tier.NVME)]
    dram = plane.tiers[(NODE_A, Tier.DRAM)].store
    victim = next(k for k in keys if k in nvme.store and k not in dram)
    entry = nvme.store.entry_of(victim)
    with open(nvme.store.segment_path(entry.seg), "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    i = keys.index(victim)
    data, loaded = load(plane, NODE_A, keys[i : i + 1])
    assert loaded == [] and data.size == 0
    assert victim not in nvme.store
    assert nvme.stats().store.quarantined == 1
    assert all(c.tier is not Tier.NVME for c in plane.lookup([victim])[0])
    check(plane)


def test_load_stops_at_the_first_block_no_one_has(plane: Plane) -> None:
    keys, payload = blocks(4, seed=5)
    store(plane, NODE_A, keys[:2] , payload[: 2 * BLOCK])
    data, loaded = load(plane, NODE_A, keys)
    assert len(loaded) == 2 and np.array_equal(data, payload[: 2 * BLOCK])
    check(plane)


def test_fallback_transport_moves_the_same_bytes_and_says_so(tmp_path) -> None:
    config = ServiceConfig(
        block_bytes=BLOCK, hbm_bytes=4 * BLOCK, dram_bytes=8 * BLOCK, nvme_bytes=64 * BLOCK,
        nvme_dir=str(tmp_path), nvme_segment_bytes=16 * BLOCK, transport="ray",
    )
    plane = make_plane(config)
    try:
        keys, payload = blocks(3, seed=6)
        store(plane, NODE_B, keys, payload)
        data, loaded = load(plane, NODE_A, keys)
        assert np.array_equal(data, payload)
        agent = plane.agents[NODE_A]
        assert agent.transport.name == "ray"
        moved_via = agent.counters.moved_via
        assert moved_via["ray"] == 3 * BLOCK and "nixl-ucx" not in moved_via
        check(plane)
    finally:
        plane.close()


def test_a_load_larger_than_the_peers_memory_moves_window_by_window(tmp_path) -> None:
    config = ServiceConfig(
        block_bytes=BLOCK, hbm_bytes=16 * BLOCK, dram_bytes=4 * BLOCK, nvme_bytes=256 * BLOCK,
        nvme_dir=str(tmp_path), nvme_segment_bytes=16 * BLOCK, directory_shards=2,
        placement="write_through",  # every block reaches B's NVMe as it is stored
    )
    # B runs A's calls in any order, as a Ray actor serving them concurrently may: A must
    # wait for B to let go of one window before asking for the next.
    plane = make_plane(config, link_type=LaggingLink)
    try:
        keys, payload = blocks(12, seed=7)
        store(plane, NODE_B, keys, payload)
        plane.tiers[(NODE_B, Tier.DRAM)].evict(keys)  # only B's NVMe has them now
        plane.tiers[(NODE_B, Tier.HBM)].evict(keys)
        # B stages NVMe blocks into its DRAM, which holds 4 at a time: three windows.
        data, loaded = load(plane, NODE_A, keys)
        assert len(loaded) == 12 and np.array_equal(data, payload)
        assert plane.agents[NODE_B].counters.moved["nvme->dram"] == 12 * BLOCK
        check(plane)
    finally:
        plane.close()


def test_nvme_admission_keeps_blocks_seen_once_off_the_disk(tmp_path) -> None:
    config = ServiceConfig(
        block_bytes=BLOCK, hbm_bytes=4 * BLOCK, dram_bytes=8 * BLOCK, nvme_bytes=64 * BLOCK,
        nvme_dir=str(tmp_path), nvme_segment_bytes=16 * BLOCK, nvme_admission_min_count=2,
    )
    plane = make_plane(config, nodes=(NODE_A,))
    try:
        agent = plane.agents[NODE_A]
        hot, hot_payload = blocks(4, seed=8)
        store(plane, NODE_A, hot, hot_payload)
        load(plane, NODE_A, hot)  # seen twice: admitted to NVMe
        cold, cold_payload = blocks(4, seed=9)
        store(plane, NODE_A, cold, cold_payload)  # seen once
        filler, filler_payload = blocks(8, seed=10)
        store(plane, NODE_A, filler, filler_payload)  # evicts hot and cold from DRAM
        nvme = plane.tiers[(NODE_A, Tier.NVME)].store
        assert all(k in nvme for k in hot)
        assert not any(k in nvme for k in cold)
        assert agent.counters.dropped["not_admitted_to_nvme"] >= 4
        check(plane)
    finally:
        plane.close()


def test_write_through_puts_admitted_blocks_on_nvme_as_they_are_stored(tmp_path) -> None:
    config = ServiceConfig(
        block_bytes=BLOCK, hbm_bytes=4 * BLOCK, dram_bytes=8 * BLOCK, nvme_bytes=64 * BLOCK,
        nvme_dir=str(tmp_path), nvme_segment_bytes=16 * BLOCK, placement="write_through",
    )
    plane = make_plane(config, nodes=(NODE_A,))
    try:
        keys, payload = blocks(3, seed=11)
        store(plane, NODE_A, keys, payload)
        assert all({Tier.DRAM, Tier.NVME} <= {c.tier for c in copies}
                   for copies in plane.lookup(keys))
        check(plane)
    finally:
        plane.close()
