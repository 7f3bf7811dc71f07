"""Partial loads through an agent on a DPU when a step fails: a host call that times out
while its gather still runs, a peer holding the host's staging, a crossing that changes a
block, an outbox that cannot be had, a copy stored again before a quarantine. Each returns
exact bytes or a miss, drops only the copy found bad, and leaves nothing held.

The endpoint and both agents run in this process (real NIXL), as in ``test_dpu_slices``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dpu_plane import A, B, dpu, dpu_plane, stored_on_dpu
from plane import Plane
from scenarios import BLOCK, LAYOUT, held

import cmx.actors.dpu.host as dpu_host
from cmx.actors.dpu.staging import LOCAL_STAGING_SLOTS
from cmx.actors.slices.pull import SlicePuller
from cmx.actors.transport.base import TransferError
from cmx.doors import Request
from cmx.keys import BlockHash
from cmx.selection import Selection, SlicedBlock, gather
from cmx.storage.nvme.chunks import block_sums
from cmx.tiers import Tier

RUNS = Selection.of(LAYOUT, heads=1).runs(LAYOUT)


@pytest.fixture(params=["nixl", "ray"])
def plane(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plane]:
    with dpu_plane(request.param, tmp_path) as p:
        yield p


def selection(payload: np.ndarray, i: int) -> bytes:
    return gather(payload[i * BLOCK:(i + 1) * BLOCK], RUNS).tobytes()


def sliced(plane: Plane, node: str, keys: list[BlockHash]) -> list[SlicedBlock]:
    return plane.agents[node].load_slices(keys, plane.lookup(keys), RUNS)


def only_nvme(plane: Plane, keys: list[BlockHash]) -> list[BlockHash]:
    return [k for k in keys if {c.tier for c in plane.lookup([k])[0]} == {Tier.NVME}]


def flip_on_disk(plane: Plane, key: BlockHash) -> None:
    nvme = plane.tiers[(A, Tier.NVME)]
    entry = nvme.store.entry_of(key)
    with open(nvme.store.segment_path(entry.seg), "r+b") as f:
        f.seek(entry.offset + RUNS[0][0])
        byte = f.read(1)
        f.seek(entry.offset + RUNS[0][0])
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_gather_that_lands_late_never_answers_for_another_block(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=51)
    k1, k2 = only_nvme(plane, keys)[:2]
    endpoint = dpu(plane).host.nixl._endpoint  # type: ignore[attr-defined]
    real = endpoint.select_extent
    go = threading.Event()
    late: list[threading.Thread] = []

    def times_out(extent: Any, runs: Any, slot: int) -> int | None:
        # The call's answer is lost (Ray's timeout), while the gather into k1's slot runs on.
        t = threading.Thread(target=lambda: (go.wait(30), real(extent, runs, slot)))
        t.start()
        late.append(t)
        raise TransferError("host endpoint: GetTimeoutError")

    monkeypatch.setattr(endpoint, "select_extent", times_out)
    assert sliced(plane, A, [k1]) == []  # a miss, the slot's outcome unknown
    monkeypatch.setattr(endpoint, "select_extent", real)
    real_sum = dpu_host.checksum

    def lands_late(data: np.ndarray) -> int:
        if late:  # k1's gather lands now, while k2's is taken
            go.set()
            late.pop().join()
        return real_sum(data)

    monkeypatch.setattr(dpu_host, "checksum", lands_late)
    got = sliced(plane, A, [k2])
    assert [b.data.tobytes() for b in got] == [selection(payload, keys.index(k2))]
    assert not late


def test_a_peer_holding_the_hosts_staging_leaves_this_nodes_loads_their_slots(
        plane: Plane) -> None:
    keys, payload = stored_on_dpu(plane, 40, seed=52)
    agent = dpu(plane)
    on_nvme = only_nvme(plane, keys)
    box = agent.host.outbox()
    exposure = agent.expose_selection(on_nvme, RUNS, "a-peer")  # a peer between two calls
    exposed = [e for e in exposure.slices if e is not None]
    assert len(exposed) == box.region.num_slots - LOCAL_STAGING_SLOTS and exposure.later
    try:
        got = sliced(plane, A, on_nvme[-1:])
        assert [b.data.tobytes() for b in got] == [selection(payload, keys.index(on_nvme[-1]))]
    finally:
        agent.release_selection(exposed)
    assert box.free_slots() == box.region.num_slots


def test_an_outbox_that_cannot_be_had_leaves_no_nvme_pin(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, _ = stored_on_dpu(plane, 12, seed=53)
    agent = dpu(plane)
    agent.host._outbox = None

    def no_staging() -> None:
        raise TransferError("the host endpoint has no staging region")

    monkeypatch.setattr(agent.host.nixl, "staging", no_staging)
    with pytest.raises(TransferError):
        agent.expose_selection(only_nvme(plane, keys), RUNS, "a-peer")
    assert held(plane, A, Tier.NVME) == (0, 0)


def test_a_crossing_that_changes_one_block_costs_that_block_alone(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=54)
    agent = dpu(plane)
    dram = plane.tiers[(A, Tier.DRAM)]
    pin = dram.pin([keys[-1]], "test")[0]  # the last block: the one whose crossing changes
    dram.unpin([pin.lease])
    real = agent.host.nixl.read_runs
    changed: list[tuple[str, int]] = []

    def changes_the_first(arena: str, slot: int, runs: Any) -> np.ndarray:
        data = real(arena, slot, runs)
        if not changed and (arena, slot) == (dram.info().arena, pin.slot):
            changed.append((arena, slot))
            data = data.copy()
            data[0] ^= 0xFF
        return data

    monkeypatch.setattr(agent.host.nixl, "read_runs", changes_the_first)
    got = sliced(plane, A, keys)
    assert changed  # the blocks before the changed one are kept
    assert [b.data.tobytes() for b in got] == [selection(payload, i) for i in range(11)]
    for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
        assert held(plane, A, tier) == (0, 0)
    assert plane.tiers[(A, Tier.DRAM)].stats().store.quarantined == 0  # the copy is intact
    assert len(sliced(plane, A, keys)) == 12


def test_an_exposure_quarantines_the_copy_it_read_not_one_stored_since(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, payload = stored_on_dpu(plane, 12, seed=55)
    agent = dpu(plane)
    victim = only_nvme(plane, keys)[0]
    block = payload[keys.index(victim) * BLOCK:(keys.index(victim) + 1) * BLOCK]
    nvme = plane.tiers[(A, Tier.NVME)]
    flip_on_disk(plane, victim)
    real_call = agent.tiers.call
    stored_again: list[bool] = []

    def call(tier: Tier, request: Request[Any]) -> Any:
        if tier is Tier.NVME and request.method.startswith("quarantine") and not stored_again:
            # After the exposure's unpin, before its quarantine: the key stored again, intact.
            assert nvme.evict([victim]) == 1
            ext = nvme.reserve([(victim, None, BLOCK)], "writer")[0]
            with open(ext.path, "r+b") as f:
                f.seek(ext.offset)
                f.write(block.tobytes())
            csum, chunks = block_sums(block)
            assert nvme.commit([(ext.lease, BLOCK, csum, chunks)]) == 1
            stored_again.append(True)
        return real_call(tier, request)

    monkeypatch.setattr(agent.tiers, "call", call)
    exposure = agent.expose_selection([victim], RUNS, "a-peer")
    assert exposure.slices == (None,) and stored_again
    assert nvme.contains([victim]) == [True]  # the copy stored since stays


def test_a_peer_that_finds_a_staged_selection_changed_leaves_the_disk_copy(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    if plane.config.transport != "nixl":
        pytest.skip("the staging is read over NIXL only")
    keys, payload = stored_on_dpu(plane, 12, seed=56)
    victim = only_nvme(plane, keys)[0]
    staging = dpu(plane).host.nixl._endpoint._staging  # type: ignore[attr-defined]
    real_land = SlicePuller._land

    def overwritten(self: SlicePuller, actor: str, exposed: Any) -> Any:
        staging[:] ^= 0x5A  # the slot reused under the reader (its lease ran out)
        return real_land(self, actor, exposed)

    monkeypatch.setattr(SlicePuller, "_land", overwritten)
    assert sliced(plane, B, [victim]) == []  # a miss
    monkeypatch.setattr(SlicePuller, "_land", real_land)
    assert {c.tier for c in plane.lookup([victim])[0]} == {Tier.NVME}  # not quarantined
    got = sliced(plane, B, [victim])
    assert [b.data.tobytes() for b in got] == [selection(payload, keys.index(victim))]
