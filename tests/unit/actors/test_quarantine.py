"""A quarantine names the copy its reader found corrupt: the tier's incarnation and the copy
(a memory slot's copy, an NVMe extent). A copy of the same key stored since, in a tier that
restarted or in the same one, is never dropped for it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
from plane import Plane, make_plane
from scenarios import BLOCK, blocks, check, load, restart_tier, small_config

from cmx.client.node_plane import NodePlane
from cmx.doors import Request, Unpin
from cmx.links import LocalLink
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"quar-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host


class HookLink(LocalLink):
    """LocalLink that runs ``after_unpin`` once, right after the first ``unpin`` sent to
    ``hook_tier``: the step between a reader's unpin and its quarantine."""

    after_unpin: Any = None
    hook_tier = Tier.NVME

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        answer = super().call(name, request)
        if (isinstance(request, Unpin) and self.after_unpin is not None
                and name.split(":")[1] == self.hook_tier.value):
            hook, self.after_unpin = self.after_unpin, None
            hook()
        return answer


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path, placement="write_through"), nodes=(NODE,),
                   link_type=HookLink)
    yield p
    p.close()


def corrupt_local(plane: Plane, reader: NodePlane, key: bytes) -> list[Any]:
    """The reader's pins of ``key``, whose copy it found corrupt."""
    pins = reader.pin_prefix([key], "client:reader")
    assert [p.tier for p in pins] == [Tier.DRAM]
    reader.payload(pins[0])[7] ^= 0xFF
    return pins


def test_a_quarantine_sent_after_the_tier_restarted_keeps_the_copy_stored_since(
    plane: Plane,
) -> None:
    keys, payload = blocks(1, seed=1)
    agent, reader = plane.agents[NODE], NodePlane(plane.link, NODE, 5.0)
    assert agent.store(keys, [None], payload) == 1
    pins = corrupt_local(plane, reader, keys[0])
    fresh = restart_tier(plane, NODE, Tier.DRAM)  # a new incarnation, empty
    assert agent.store(keys, [None], payload) == 1  # a good copy, in the new one
    reader.quarantine(pins)  # names the old incarnation's copy: nothing here
    assert fresh.contains(keys) == [True] and fresh.stats().store.quarantined == 0
    pins = reader.pin_prefix(keys, "client:reader")
    assert bytes(reader.payload(pins[0])) == bytes(payload)
    reader.unpin(pins)
    reader.close()
    check(plane)


def test_a_quarantine_sent_after_the_pin_ended_keeps_the_copy_stored_since(
    plane: Plane,
) -> None:
    keys, payload = blocks(1, seed=2)
    agent, reader = plane.agents[NODE], NodePlane(plane.link, NODE, 5.0)
    dram = plane.tiers[(NODE, Tier.DRAM)]
    assert agent.store(keys, [None], payload) == 1
    pins = corrupt_local(plane, reader, keys[0])
    reader.unpin(pins)
    dram.store.delete(keys[0])  # evicted, then stored again: the same slot, a new copy
    assert agent.store(keys, [None], payload) == 1
    reader.quarantine(pins)
    assert dram.contains(keys) == [True] and dram.stats().store.quarantined == 0
    again = reader.pin_prefix(keys, "client:reader")
    assert bytes(reader.payload(again[0])) == bytes(payload)
    reader.unpin(again)
    reader.quarantine(again)  # the copy a pin names, when it is the one held, goes
    assert dram.contains(keys) == [False] and dram.stats().store.quarantined == 1
    reader.close()
    check(plane)


def test_a_partial_nvme_load_quarantines_the_extent_it_read_not_one_written_since(
    plane: Plane,
) -> None:
    keys, payload = blocks(1, seed=3)
    agent, nvme = plane.agents[NODE], plane.tiers[(NODE, Tier.NVME)]
    assert agent.store(keys, [None], payload) == 1  # DRAM, and NVMe by write-through
    for tier in (Tier.HBM, Tier.DRAM):
        plane.tiers[(NODE, tier)].evict(keys)
    [ext] = nvme.pin(keys, "test")
    fd = os.open(ext.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([payload[5] ^ 0xFF]), ext.offset + 5)
        os.fsync(fd)
    finally:
        os.close(fd)
    nvme.unpin([ext.lease])

    def replace_with_a_good_copy() -> None:  # the bad one deleted, a good one written after
        assert nvme.evict(keys) == 1
        assert agent.store(keys, [None], payload) == 1
        plane.tiers[(NODE, Tier.DRAM)].evict(keys)

    plane.link.after_unpin = replace_with_a_good_copy  # type: ignore[attr-defined]
    assert agent.read_selection(keys, ((0, 64),)) == [None]  # never the corrupt bytes
    assert plane.link.after_unpin is None  # type: ignore[attr-defined]
    assert nvme.contains(keys) == [True] and nvme.stats().store.quarantined == 0
    [s] = agent.read_selection(keys, ((0, 64),))
    assert s is not None and s.source_tier is Tier.NVME and bytes(s.data) == bytes(payload[:64])
    data, _ = load(plane, NODE, keys)
    assert np.array_equal(data, payload[:BLOCK])
    check(plane)


def test_a_load_released_with_a_corrupt_block_drops_that_hbm_copy_not_one_loaded_since(
    plane: Plane,
) -> None:
    keys, payload = blocks(1, seed=4)
    agent, hbm = plane.agents[NODE], plane.tiers[(NODE, Tier.HBM)]
    assert agent.store(keys, [None], payload) == 1  # DRAM, and NVMe by write-through
    result = agent.load(keys, plane.lookup(keys))
    [b] = result.blocks
    assert b.source_tier is Tier.DRAM
    agent.tiers.current(Tier.HBM)[1].slot_view(b.slot)[3] ^= 0xFF  # the copy the reader read

    def load_it_again() -> None:  # the corrupt copy gone, a fresh one loaded from NVMe
        hbm.evict(keys)
        plane.tiers[(NODE, Tier.DRAM)].evict(keys)
        again = agent.load(keys, plane.lookup(keys))
        assert [a.source_tier for a in again.blocks] == [Tier.NVME]
        agent.release([a.lease for a in again.blocks])

    plane.link.hook_tier = Tier.HBM  # type: ignore[attr-defined]
    plane.link.after_unpin = load_it_again  # type: ignore[attr-defined]
    agent.release([b.lease], [b])
    assert hbm.contains(keys) == [True]  # the copy loaded since stays
    data, _ = load(plane, NODE, keys)
    assert np.array_equal(data, payload)
    check(plane)
