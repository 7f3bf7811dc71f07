"""Partial (head or layer) loads through an agent on a DPU: each block is checked whole on
the host, where its bytes are, and only the selection crosses, to this node's client or to a
peer. A copy that fails its check on the host is a miss and is quarantined there; nothing
stays pinned or leased, and the DPU's process never maps a host arena.

The endpoint and both agents run in this process (real NIXL); the test corrupts node-a's
copies the way its host would see them, through the tiers' own arenas and files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dpu_plane import A, B, dpu, dpu_plane, stored_on_dpu
from plane import Plane
from scenarios import BLOCK, LAYOUT, check, held

from cmx.keys import BlockHash
from cmx.selection import Selection, SlicedBlock, gather
from cmx.tiers import Tier

RUNS = Selection.of(LAYOUT, heads=1).runs(LAYOUT)
SEL = Selection.of(LAYOUT, heads=1).block_bytes(LAYOUT)


@pytest.fixture(params=["nixl", "ray"])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    with dpu_plane(request.param, tmp_path) as p:
        yield p


def selections(payload: np.ndarray, n: int) -> list[bytes]:
    return [gather(payload[i * BLOCK:(i + 1) * BLOCK], RUNS).tobytes() for i in range(n)]


def sliced(plane: Plane, node: str, keys: list[BlockHash]) -> list[SlicedBlock]:
    return plane.agents[node].load_slices(keys, plane.lookup(keys), RUNS)


def only_in(plane: Plane, keys: list[BlockHash], tier: Tier) -> BlockHash:
    return next(k for k in keys if {c.tier for c in plane.lookup([k])[0]} == {tier})


def nothing_held(plane: Plane) -> None:
    for node in (A, B):
        for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
            assert held(plane, node, tier) == (0, 0), (node, tier)
    box = dpu(plane).host.outbox()
    assert box.free_slots() == box.region.num_slots
    box.check_integrity()
    check(plane)


def test_the_dpus_host_loads_selections_from_its_dram_and_nvme(plane: Plane) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=41)
    tiers = [{c.tier for c in cs} for cs in plane.lookup(keys)]
    assert {Tier.NVME} in tiers and any(Tier.DRAM in t for t in tiers)
    agent = dpu(plane)
    before = agent.host.nixl.bytes_read
    got = sliced(plane, A, keys)
    assert [b.data.tobytes() for b in got] == selections(payload, 12)
    assert {b.source_tier for b in got} == {Tier.DRAM, Tier.NVME}
    assert agent.host.nixl.bytes_read - before == 12 * SEL  # only the selections crossed
    assert [{c.tier for c in cs} for cs in plane.lookup(keys)] == tiers  # nothing promoted
    nothing_held(plane)


def test_a_peer_loads_selections_that_live_only_on_the_dpus_host(plane: Plane) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=42)
    got = sliced(plane, B, keys)
    assert [b.data.tobytes() for b in got] == selections(payload, 12)
    assert {b.source_node for b in got} == {A}
    reader = plane.agents[B]
    if plane.config.transport == "nixl":  # read straight from the host's memory and staging
        assert reader.transport.stats.range_bytes == 12 * SEL
    else:
        assert reader.counters.moved_via["ray"] == 12 * SEL
    nothing_held(plane)


def test_a_corrupt_copy_in_the_hosts_dram_is_a_miss_and_quarantined(plane: Plane) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=43)
    victim = only_in(plane, keys, Tier.DRAM)
    dram = plane.tiers[(A, Tier.DRAM)]
    pin = dram.pin([victim], "test")[0]
    dram.store.arena.slot_view(pin.slot)[RUNS[0][0]] ^= 0xFF  # inside the selection
    dram.unpin([pin.lease])
    i = keys.index(victim)
    for node in (A, B):  # the host's own load, then a peer's: the first quarantines it
        got = sliced(plane, node, keys)
        assert [b.data.tobytes() for b in got] == selections(payload, i)
    assert dram.stats().store.quarantined == 1
    assert plane.lookup([victim])[0] == []
    nothing_held(plane)


def test_a_corrupt_chunk_on_the_hosts_nvme_is_a_miss_and_quarantined(plane: Plane) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=44)
    victim = only_in(plane, keys, Tier.NVME)
    nvme = plane.tiers[(A, Tier.NVME)]
    entry = nvme.store.entry_of(victim)
    with open(nvme.store.segment_path(entry.seg), "r+b") as f:  # the host's file
        f.seek(entry.offset + RUNS[0][0])
        byte = f.read(1)
        f.seek(entry.offset + RUNS[0][0])
        f.write(bytes([byte[0] ^ 0xFF]))
    node = B if plane.config.transport == "nixl" else A  # a peer's exposure; the host's read
    got = sliced(plane, node, [victim])
    assert got == []
    assert plane.lookup([victim])[0] == []
    nothing_held(plane)
