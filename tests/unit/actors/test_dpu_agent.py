"""An agent on a DPU among the other nodes: node-a's agent reaches its host only through NIXL
(a host endpoint with its arenas registered), node-b's is an ordinary agent. Blocks travel
between the nodes both ways, HBM victims of the DPU's host move down to its DRAM, and a host
tier that restarts between two steps takes no copy into its earlier incarnation.

The endpoint and both agents run in this process (real NIXL, UCX between the agents); the
test reads node-a's slots the way its host does, through the tiers' own arenas.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dpu_plane import A, B, dpu, dpu_plane
from plane import Plane
from scenarios import BLOCK, blocks, check, load, restart_tier

from cmx.actors.agent.shared import StaleEpochError
from cmx.keys import BlockHash
from cmx.protocol import Loaded
from cmx.tiers import Tier


@pytest.fixture(params=["nixl", "ray"])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    with dpu_plane(request.param, tmp_path) as p:
        yield p


def load_on_dpu(plane: Plane, keys: list[BlockHash]) -> tuple[np.ndarray, list[Loaded]]:
    """A load on node-a, its HBM slots read where its host reads them."""
    agent = dpu(plane)
    result = agent.load(keys, plane.lookup([bytes(k) for k in keys]))
    hbm = plane.tiers[(A, Tier.HBM)].store.arena
    data = np.concatenate([hbm.slot_view(b.slot)[: b.size] for b in result.blocks]
                          or [np.empty(0, np.uint8)]).copy()
    agent.release([b.lease for b in result.blocks])
    return data, result.blocks


def test_a_peer_loads_a_prefix_that_lives_only_on_the_dpus_host(plane: Plane) -> None:
    keys, payload = blocks(3, seed=1)
    assert dpu(plane).store(keys, [None, *keys[:-1]], payload) == 3
    data, loaded = load(plane, B, keys)
    assert [b.source_node for b in loaded] == [A] * 3
    assert np.array_equal(data, payload)
    check(plane)


def test_the_dpus_host_loads_a_prefix_that_lives_only_on_a_peer(plane: Plane) -> None:
    keys, payload = blocks(3, seed=2)
    assert plane.agents[B].store(keys, [None, *keys[:-1]], payload) == 3
    data, loaded = load_on_dpu(plane, keys)
    assert [b.source_node for b in loaded] == [B] * 3
    assert np.array_equal(data, payload)
    assert dpu(plane).host.bounced == 3 * BLOCK  # through the DPU's memory, never the host's map
    check(plane)


def test_hbm_victims_of_the_dpus_host_move_to_its_dram(plane: Plane) -> None:
    agent = dpu(plane)
    far, far_payload = blocks(4, seed=3)  # only on node-b: once pulled, only in a's HBM
    near, near_payload = blocks(4, seed=4)
    plane.agents[B].store(far, [None] * 4, far_payload)
    agent.store(near[:2], [None] * 2, near_payload[: 2 * BLOCK])
    assert len(load_on_dpu(plane, far)[1]) == 4  # HBM (4 slots) holds far
    assert len(load_on_dpu(plane, near[:2])[1]) == 2  # evicts two of far
    assert agent.counters.dropped["demotion_failed"] == 0
    assert agent.counters.moved["hbm->dram"] == 2 * BLOCK
    dram = plane.tiers[(A, Tier.DRAM)]
    moved = [k for k in far if dram.contains([k])[0]]
    assert len(moved) == 2
    for key in moved:
        i = far.index(key)
        pin = dram.pin([key], "test")[0]
        got = dram.store.arena.slot_view(pin.slot)[: pin.size]
        assert np.array_equal(got, far_payload[i * BLOCK:(i + 1) * BLOCK])
        dram.unpin([pin.lease])
    check(plane)


def test_no_copy_lands_in_a_host_tier_that_restarted_between_two_steps(plane: Plane) -> None:
    agent = dpu(plane)
    (k1,), p1 = blocks(1, seed=5)
    (k2,), p2 = blocks(1, seed=6)
    grants = agent.grant_store([k1], [None], agent.owner)  # step one: a slot of DRAM's epoch
    old = plane.tiers[(A, Tier.DRAM)]
    new = restart_tier(plane, A, Tier.DRAM)
    assert agent.store([k2], [None], p2) == 1  # the agent re-resolves the new incarnation
    with pytest.raises(StaleEpochError):  # step two: the copy into the old incarnation
        agent.host.copy_in(grants, p1, BLOCK)
    arenas = agent.host.endpoint.arenas()  # type: ignore[attr-defined]
    assert arenas == sorted([new.info().arena, plane.tiers[(A, Tier.HBM)].info().arena])
    assert old.info().arena not in arenas
    assert not dram_holds(new, k1)
    data, loaded = load_on_dpu(plane, [k2])
    assert len(loaded) == 1 and np.array_equal(data, p2)
    old.close()
    check(plane)


def dram_holds(tier: object, key: BlockHash) -> bool:
    return bool(tier.contains([key])[0])  # type: ignore[attr-defined]


def test_compaction_on_the_dpus_host_is_moved_by_its_endpoint(tmp_path: Path) -> None:
    with dpu_plane("nixl", tmp_path, hbm_bytes=16 * BLOCK, dram_bytes=32 * BLOCK,
                   nvme_bytes=64 * BLOCK, nvme_segment_bytes=16 * BLOCK,
                   placement="write_through") as p:
        agent, nvme = dpu(p), p.tiers[(A, Tier.NVME)]
        keys, payload = blocks(80, seed=7)
        agent.store(keys[:64], [None, *keys[:63]], payload[: 64 * BLOCK])
        assert nvme.evict(keys[0:48:2]) == 24  # a third of the log is dead: compaction's turn
        agent.store(keys[64:], keys[63:79], payload[64 * BLOCK:])
        extra = nvme.store.stats().extra
        assert extra["compactions"] >= 1 and extra["compacted_bytes"] > 0
        assert agent.counters.moved["nvme->nvme"] == extra["compacted_bytes"]
        survivors = [i for i in range(80) if keys[i] in nvme.store]
        assert set(range(1, 48, 2)) <= set(survivors)  # compaction kept every live block
        for i in survivors:
            extent = nvme.pin([keys[i]], "test")[0]
            got = np.empty(extent.size, np.uint8)
            with open(extent.path, "rb") as f:  # the host's own file, read as the host does
                f.seek(extent.offset)
                got[:] = np.frombuffer(f.read(extent.size), np.uint8)
            nvme.unpin([extent.lease])
            assert np.array_equal(got, payload[i * BLOCK:(i + 1) * BLOCK])
        check(p)
