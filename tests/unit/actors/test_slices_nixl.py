"""Partial loads between two nodes' agents over NIXL, in one process: only the selected byte
ranges cross, in one transfer per window; exact bytes; a corrupt source copy is a miss and is
quarantined; without NIXL the same bytes travel by value, and that is counted."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import BLOCK, LAYOUT, blocks, check, held, small_config

from cmx.actors.pool.node import PoolNodeService
from cmx.actors.slices import expose as slice_expose
from cmx.actors.slices.expose import (
    ExposedSlice,
    SliceOutbox,
    exposed_ranges,
    read_descriptors,
    selection_checksum,
)
from cmx.checksum import checksum
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.protocol import Offer
from cmx.selection import Selection, gather
from cmx.tiers import Tier

HEAD1 = Selection.of(LAYOUT, heads=1)
RUNS = HEAD1.runs(LAYOUT)
SEL = HEAD1.block_bytes(LAYOUT)


def exposed(region: str, ranges: tuple[tuple[int, int], ...]) -> ExposedSlice:
    return ExposedSlice(BlockHash(b"k"), region, ranges, 0, Tier.DRAM, 1)


# -- the descriptors of one read ------------------------------------------------------------


def test_descriptors_address_each_range_at_its_owner_and_land_blocks_back_to_back() -> None:
    a = exposed("arena", exposed_ranges(3 * 1000, ((0, 10), (50, 20))))
    b = exposed("outbox", ((200, 30),))
    remote, local = read_descriptors([a, b], {"arena": 1 << 20, "outbox": 1 << 30}, 4096)
    assert remote.tolist() == [[(1 << 20) + 3000, 10, 0], [(1 << 20) + 3050, 20, 0],
                               [(1 << 30) + 200, 30, 0]]
    assert local.tolist() == [[4096, 10, 0], [4106, 20, 0], [4126, 30, 0]]
    assert remote.dtype == np.uint64 and local.dtype == np.uint64


def test_ranges_adjacent_at_both_ends_travel_as_one_descriptor() -> None:
    # Two neighbouring slots whose selections meet (a whole-block selection of each).
    a = exposed("arena", exposed_ranges(0, ((0, 100),)))
    b = exposed("arena", exposed_ranges(100, ((0, 100),)))
    c = exposed("arena", exposed_ranges(300, ((0, 100),)))  # a gap at the owner
    remote, local = read_descriptors([a, b, c], {"arena": 5000}, 0)
    assert remote.tolist() == [[5000, 200, 0], [5300, 100, 0]]
    assert local.tolist() == [[0, 200, 0], [200, 100, 0]]


def test_the_selection_checksum_is_that_of_the_gathered_bytes() -> None:
    payload = np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8)
    assert selection_checksum(payload, RUNS) == checksum(gather(payload, RUNS))
    assert sum(n for _, n in RUNS) == SEL < BLOCK


def test_an_outbox_leases_its_slots_and_takes_back_expired_ones() -> None:
    now = [0.0]
    box = SliceOutbox("box", 4096, 2, lease_s=10.0, clock=lambda: now[0])
    first, second = box.take("r", BlockHash(b"a")), box.take("r", BlockHash(b"b"))
    assert first is not None and second is not None and first[0] != second[0]
    assert box.take("r", BlockHash(b"c")) is None  # full: the reader asks again later
    box.end([first[1]])
    assert box.free_slots() == 1
    now[0] = 11.0  # the other reader never released: its slot comes back at expiry
    assert box.take("r", BlockHash(b"d")) is not None and box.free_slots() == 1
    box.check_integrity()


# -- two agents ----------------------------------------------------------------------------


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path))
    yield p
    p.close()


def load_slices(plane: Plane, node: str, keys: list[BlockHash]) -> list[Any]:
    return plane.agents[node].load_slices(keys, plane.lookup(keys), RUNS)


def expected(payload: np.ndarray, n: int) -> list[np.ndarray]:
    return [gather(payload[i * BLOCK : (i + 1) * BLOCK], RUNS) for i in range(n)]


def only_in(plane: Plane, node: str, keys: list[BlockHash], tier: Tier) -> BlockHash:
    return next(k for k in keys
                if {(c.tier, c.node) for c in plane.lookup([k])[0]} == {(tier, node)})


def test_a_peer_selection_moves_only_its_ranges_over_nixl(plane: Plane) -> None:
    keys, payload = blocks(12, seed=31)  # B's DRAM holds 8: the rest only on its NVMe
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    before = [{c.tier for c in cs} for cs in plane.lookup(keys)]
    assert any(t == {Tier.NVME} for t in before) and any(Tier.DRAM in t for t in before)
    a = plane.agents[NODE_A]
    got = load_slices(plane, NODE_A, keys)
    assert [b.data.tobytes() for b in got] == [e.tobytes() for e in expected(payload, 12)]
    assert {b.source_tier for b in got} == {Tier.DRAM, Tier.NVME}
    assert a.transport.stats.range_bytes == 12 * SEL  # the selected bytes, not 12 blocks
    # One READ for all: 4 runs a block (K and V of 2 layers), 48 descriptors.
    assert a.transport.stats.range_reads == 1 and a.transport.stats.bytes_read == 12 * SEL
    moved, moved_via = a.counters.moved, a.counters.moved_via
    assert moved_via[a.transport.name] == 12 * SEL and moved_via["ray"] == 0
    assert moved["dram@peer->selection"] + moved["nvme@peer->selection"] == 12 * SEL
    # Nothing stays pinned or leased on B, and nothing was promoted there.
    for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
        assert held(plane, NODE_B, tier) == (0, 0), tier
    plane.agents[NODE_B].host.outbox().check_integrity()
    assert [{c.tier for c in cs} for cs in plane.lookup(keys)] == before
    check(plane)


def test_nvme_selections_wider_than_the_outbox_come_in_windows(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slice_expose, "OUTBOX_MAX_SLOTS", 2)
    keys, payload = blocks(16, seed=32)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    on_nvme = sum({c.tier for c in cs} == {Tier.NVME} for cs in plane.lookup(keys))
    assert on_nvme > 2
    a = plane.agents[NODE_A]
    got = load_slices(plane, NODE_A, keys)
    assert [b.data.tobytes() for b in got] == [e.tobytes() for e in expected(payload, 16)]
    assert a.transport.stats.range_bytes == 16 * SEL
    assert a.transport.stats.range_reads >= on_nvme // 2  # a window per two NVMe blocks
    box = plane.agents[NODE_B].host.outbox()
    assert box.region.num_slots == 2 and box.free_slots() == 2
    box.check_integrity()


def flip_dram_byte(plane: Plane, node: str, key: BlockHash) -> None:
    dram = plane.tiers[(node, Tier.DRAM)]
    pin = dram.pin([key])[0]
    arena = plane.agents[node].tiers.current(Tier.DRAM)[1]
    arena.slot_view(pin.slot)[7] ^= 0xFF
    dram.unpin([pin.lease])


def test_a_corrupt_peer_dram_copy_is_a_miss_and_quarantined_there(plane: Plane) -> None:
    keys, payload = blocks(12, seed=33)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    victim = only_in(plane, NODE_B, keys, Tier.DRAM)
    flip_dram_byte(plane, NODE_B, victim)
    i = keys.index(victim)
    got = load_slices(plane, NODE_A, keys)
    assert len(got) == i  # the prefix ends at the corrupt block
    assert [b.data.tobytes() for b in got] == [e.tobytes() for e in expected(payload, i)]
    assert plane.tiers[(NODE_B, Tier.DRAM)].stats().store.quarantined == 1
    assert plane.lookup([victim])[0] == []
    assert held(plane, NODE_B, Tier.DRAM) == (0, 0)
    check(plane)


def test_a_corrupt_peer_nvme_chunk_is_a_miss_and_quarantined_there(plane: Plane) -> None:
    keys, payload = blocks(12, seed=34)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    victim = only_in(plane, NODE_B, keys, Tier.NVME)
    nvme = plane.tiers[(NODE_B, Tier.NVME)]
    entry = nvme.store.entry_of(victim)
    run_off = RUNS[0][0]  # a byte inside the selection, so its chunk is read
    with open(nvme.store.segment_path(entry.seg), "r+b") as f:
        f.seek(entry.offset + run_off)
        byte = f.read(1)
        f.seek(entry.offset + run_off)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = load_slices(plane, NODE_A, [victim])
    assert got == []
    assert nvme.stats().store.quarantined == 1 and victim not in nvme.store
    plane.agents[NODE_B].host.outbox().check_integrity()
    check(plane)


def test_bytes_damaged_in_flight_are_a_miss_and_the_source_copy_is_quarantined(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = blocks(3, seed=35)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    a = plane.agents[NODE_A]
    real = a.transport.read_ranges

    def damaging(peer: Any, remote: Any, local: Any, landing: np.ndarray,
                 timeout_s: float = 30.0) -> int:
        n = real(peer, remote, local, landing, timeout_s)
        landing[SEL + 3] ^= 0xFF  # the second block's bytes
        return n

    monkeypatch.setattr(a.transport, "read_ranges", damaging)
    got = load_slices(plane, NODE_A, keys)
    assert len(got) == 1 and got[0].data.tobytes() == expected(payload, 1)[0].tobytes()
    assert plane.tiers[(NODE_B, Tier.DRAM)].stats().store.quarantined == 1
    assert plane.lookup([keys[1]])[0] == []
    assert held(plane, NODE_B, Tier.DRAM) == (0, 0)
    check(plane)


def test_without_nixl_the_selection_travels_by_value_and_says_so(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    p = make_plane(small_config(tmp_path, transport="ray"))
    try:
        keys, payload = blocks(4, seed=36)
        p.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
        a = p.agents[NODE_A]
        with caplog.at_level(logging.WARNING):
            got = a.load_slices(keys, p.lookup(keys), RUNS)
        assert [b.data.tobytes() for b in got] == [e.tobytes() for e in expected(payload, 4)]
        assert a.counters.moved_via["ray"] == 4 * SEL and a.transport.stats.range_bytes == 0
        assert "through Ray's object store" in caplog.text
        assert actor_name("agent", NODE_B) in caplog.text

        # By value too, the bytes are checked where they land: damaged ones end the prefix.
        owner = p.agents[NODE_B]
        real = owner.read_selection

        def damaging(keys: list[BlockHash], runs: Any) -> list[Any]:
            found = real(keys, runs)
            found[2].data[0] ^= 0xFF
            return found

        owner.read_selection = damaging  # type: ignore[method-assign]
        assert len(a.load_slices(keys, p.lookup(keys), RUNS)) == 2
    finally:
        p.close()


@pytest.fixture
def pooled(plane: Plane) -> Iterator[tuple[PoolNodeService, list[BlockHash], np.ndarray]]:
    """A pool node holding six blocks that node a stored and then dropped from its tiers."""
    cfg = plane.config
    pool = PoolNodeService("pool-1", "p1", f"{cfg.nvme_dir}/pool-p1", 64 * BLOCK, BLOCK,
                           8 * BLOCK, plane.link, cfg.directory_shards, cfg.transport,
                           segment_bytes=cfg.nvme_segment_bytes, lease_s=cfg.lease_s,
                           clock=plane.clock)
    plane.link._targets[actor_name("pool", "pool-1")] = pool  # type: ignore[attr-defined]
    try:
        keys, payload = blocks(6, seed=37)
        source = plane.agents[NODE_A]
        source.store(keys, [None, *keys[:-1]], payload)
        dram = plane.tiers[(NODE_A, Tier.DRAM)]
        pins = dram.pin(keys, source.owner)
        region = source.tiers.current(Tier.DRAM)[0].arena
        offers = [Offer(p.key, None, region, p.slot, p.size, p.checksum) for p in pins]
        assert pool.ingest(actor_name("agent", NODE_A), offers) == 6
        dram.unpin([p.lease for p in pins])
        for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
            plane.tiers[(NODE_A, tier)].evict(keys)
        assert all({c.tier for c in cs} == {Tier.POOL} for cs in plane.lookup(keys))
        pool.drop_staging()
        yield pool, keys, payload
    finally:
        del plane.link._targets[actor_name("pool", "pool-1")]  # type: ignore[attr-defined]
        pool.close()


def test_a_pool_selection_from_its_disk_then_its_staging_moves_only_its_ranges(
        plane: Plane, pooled: tuple[PoolNodeService, list[BlockHash], np.ndarray]) -> None:
    pool, keys, payload = pooled
    b = plane.agents[NODE_B]
    # First from the pool's disk (the covering chunks, via its outbox), then from its staging.
    for n in (1, 2):
        got = b.load_slices(keys, plane.lookup(keys), RUNS)
        assert [s.data.tobytes() for s in got] == [e.tobytes() for e in expected(payload, 6)]
        assert b.transport.stats.range_bytes == n * 6 * SEL
        assert b.transport.stats.range_reads == n
        assert b.counters.moved["pool@pool->selection"] == n * 6 * SEL
        assert pool.leases.stats().pinned == 0 and pool.staging.stats().pinned == 0
        pool.outbox().check_integrity()
        pool.unstage(pool.stage(keys, "agent:warm"))
    pool.check_integrity()


def test_a_corrupt_pool_copy_is_a_miss_and_quarantined_there(
        plane: Plane, pooled: tuple[PoolNodeService, list[BlockHash], np.ndarray]) -> None:
    pool, keys, payload = pooled
    entry = pool.store.entry_of(keys[3])
    with open(pool.store.segment_path(entry.seg), "r+b") as f:
        f.seek(entry.offset + RUNS[0][0])
        byte = f.read(1)
        f.seek(entry.offset + RUNS[0][0])
        f.write(bytes([byte[0] ^ 0xFF]))
    got = plane.agents[NODE_B].load_slices(keys, plane.lookup(keys), RUNS)
    assert [s.data.tobytes() for s in got] == [e.tobytes() for e in expected(payload, 3)]
    assert keys[3] not in pool.store and pool.stats().store.quarantined == 1
    assert plane.lookup([keys[3]])[0] == []
    assert pool.leases.stats().pinned == 0
    pool.outbox().check_integrity()
    pool.check_integrity()
