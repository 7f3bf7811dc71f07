"""Sync loads in groups of layers (``load_layer_groups``): layer 0's wait returns once layer 0's
group has landed, while the later groups are still being copied; the load counts only the
blocks every group brought whole and verified.

The service is the in-process plane; the prefix is held in its DRAM (each group copied out of
the pinned shared memory, its checksum known at the end), or partly on its NVMe (that part
comes whole with the first group, through the agent, and stays in memory here).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, namespace_client
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_plane import BOUND_S, LAYOUT, NAMES, NODE, T, blocks_of, connector, paged_caches, plane_of

from cmx.client.layer_loads import layer_groups
from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_meta import CMXStepMetadata, CMXWorkerReport, LoadSpec
from cmx.doors import Request
from cmx.layout import PayloadOrder
from cmx.links import LocalLink
from cmx.tiers import Tier

R = TypeVar("R")
PROMPT = tuple(range(700, 700 + 3 * T))  # three full blocks
ENGINE_BLOCKS = (5, 2, 4)


class CountingLink(LocalLink):
    """The plane's link, counting the agent's loads: whole (``load``) and by layer selection
    (``load_slices``)."""

    def __init__(self, targets: Any) -> None:
        super().__init__(targets)
        self.counts = {"load": 0, "load_slices": 0}

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if request.method in self.counts:
            self.counts[request.method] += 1
        return super().call(name, request, timeout_s=timeout_s)  # submit calls it too


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path, link_type=CountingLink, placement="write_through")
    yield p
    p.close()


def engine(plane: Plane) -> tuple[CMXConnector, list[torch.Tensor], Any, torch.Tensor]:
    """A worker-side connector loading in three groups (one layer each), and the prefix it
    finds stored."""
    conn = connector(plane, KVConnectorRole.WORKER, load_layer_groups=3)
    caches = paged_caches()
    conn.register_kv_caches(dict(zip(NAMES, caches)))
    ns = conn._side_worker().namespaces.get("").whole  # TP=1: blocks stored whole
    stored = LAYOUT.random_kv(3 * T, seed=11)
    assert ns.store(list(PROMPT), stored).wait() == 3
    return conn, caches, ns, stored


def only_on_nvme(plane: Plane, keys: Sequence[bytes]) -> None:
    deadline = time.monotonic() + BOUND_S  # write-through: NVMe's commit follows DRAM's
    while not all(Tier.NVME in {c.tier for c in cs} for cs in plane.lookup(list(keys))):
        assert time.monotonic() < deadline, "the blocks never reached NVMe"
        time.sleep(0.01)
    for tier in (Tier.HBM, Tier.DRAM):
        plane.tiers[(NODE, tier)].evict(list(keys))
    assert all({c.tier for c in cs} == {Tier.NVME} for cs in plane.lookup(list(keys)))


def step(conn: CMXConnector) -> None:
    conn.bind_connector_metadata(CMXStepMetadata(
        loads=[LoadSpec("r", "", PROMPT, 0, 3 * T, ENGINE_BLOCKS)]))
    conn.start_load_kv(None)  # type: ignore[arg-type]


def end(conn: CMXConnector) -> CMXWorkerReport:
    conn.wait_for_save()
    report = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    assert isinstance(report, CMXWorkerReport)
    return report


def hold_later_groups(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every group after a load's first wait until the test sets ``opened``; ``entered``
    is set once one is waiting."""
    from cmx.client.layer_loads import LayerLoad

    entered, opened = threading.Event(), threading.Event()
    group = LayerLoad.group

    def held_group(self: LayerLoad, layers: range) -> Any:
        if layers.start:
            entered.set()
            assert opened.wait(BOUND_S)
        return group(self, layers)

    monkeypatch.setattr(LayerLoad, "group", held_group)
    return entered, opened


def test_layer_zero_is_ready_while_the_later_groups_are_still_being_copied(
    plane: Plane, monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn, caches, ns, stored = engine(plane)
    entered, opened = hold_later_groups(monkeypatch)
    step(conn)
    conn.wait_for_layer_load(NAMES[0])
    assert entered.wait(BOUND_S)  # layer 1's group is not copied yet
    assert torch.equal(blocks_of(caches[0], list(ENGINE_BLOCKS)), stored[0])
    assert not caches[1].any() and not caches[2].any()
    opened.set()
    for layer, name in enumerate(NAMES):
        conn.wait_for_layer_load(name)
        assert torch.equal(blocks_of(caches[layer], list(ENGINE_BLOCKS)), stored[layer])
    report = end(conn)
    assert conn.get_block_ids_with_load_errors() == set()
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", 3 * T)]
    assert pins_held(plane) == 0
    conn.shutdown()


@pytest.mark.parametrize("away", [1, 3])
def test_the_part_away_comes_whole_with_the_first_group_and_stays_in_memory_here(
    plane: Plane, away: int,
) -> None:
    conn, caches, ns, stored = engine(plane)
    keys = ns.keys(list(PROMPT))
    only_on_nvme(plane, keys[3 - away:])
    step(conn)
    for layer, name in enumerate(NAMES):
        conn.wait_for_layer_load(name)
        assert torch.equal(blocks_of(caches[layer], list(ENGINE_BLOCKS)), stored[layer])
    report = end(conn)
    assert conn.get_block_ids_with_load_errors() == set()
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", 3 * T)]
    link = plane.link
    assert link.counts == {"load": 1, "load_slices": 0}  # one whole load, not one per group
    # Committed in this node's HBM (its books; the directory hears of it a moment later).
    assert all(plane.tiers[(NODE, Tier.HBM)].contains(keys[3 - away:]))
    assert pins_held(plane) == 0
    conn.shutdown()


def test_a_block_in_memory_found_corrupt_is_never_handed_to_attention(plane: Plane) -> None:
    """A byte of the last layer of the middle block flipped in DRAM: the load checks each
    block whole before its first group, so no layer of that block or the one after it
    reaches the paged cache; the engine recomputes them and the copy is quarantined."""
    conn, caches, ns, stored = engine(plane)
    keys = ns.keys(list(PROMPT))
    node_plane = ns.cm.plane
    pins = node_plane.pin_prefix(keys, "test")
    assert [p.tier for p in pins] == [Tier.DRAM] * 3
    payload = node_plane.payload(pins[1])
    payload[-1] = np.uint8(payload[-1] ^ 0xFF)  # the last layer's bytes
    node_plane.unpin(pins)
    step(conn)
    for layer, name in enumerate(NAMES):
        conn.wait_for_layer_load(name)
        assert torch.equal(blocks_of(caches[layer], [ENGINE_BLOCKS[0]]), stored[layer][:, :, :T])
        assert not blocks_of(caches[layer], list(ENGINE_BLOCKS[1:])).any()  # never written
    report = end(conn)
    assert conn.get_block_ids_with_load_errors() == set(ENGINE_BLOCKS[1:])
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", T)]
    assert Tier.DRAM not in {c.tier for c in plane.lookup([keys[1]])[0]}
    conn.shutdown()


@pytest.mark.parametrize(("layers", "groups", "sizes"), [
    (32, 4, [8, 8, 8, 8]), (3, 4, [1, 1, 1]), (10, 4, [2, 2, 3, 3]), (5, 1, [5]),
])
def test_layer_groups_cover_every_layer_in_order_the_first_no_longer(
    layers: int, groups: int, sizes: list[int],
) -> None:
    got = layer_groups(layers, groups)
    assert [len(g) for g in got] == sizes
    assert [i for g in got for i in g] == list(range(layers))


def test_groups_asked_out_of_order_are_refused(plane: Plane) -> None:
    conn, _, ns, stored = engine(plane)
    load = ns.load_layers(list(PROMPT))
    with pytest.raises(ValueError, match="does not follow"):
        load.group(range(1, 2))
    assert torch.equal(load.group(range(0, 2)), stored[:2])
    assert load.finish() == 0  # not every layer was asked: nothing counts
    conn.shutdown()


def pins_held(plane: Plane) -> int:
    return sum(plane.tiers[(NODE, t)].stats().leases.pinned for t in (Tier.HBM, Tier.DRAM))


def test_a_load_that_fails_once_its_blocks_here_are_pinned_lets_the_pins_go(
    plane: Plane, monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn, _, ns, _ = engine(plane)
    keys = ns.keys(list(PROMPT))
    match = ns.lookup(list(PROMPT), True)
    for tier in (Tier.HBM, Tier.DRAM):  # the last block goes after the lookup: asked again
        plane.tiers[(NODE, tier)].evict([keys[2]])

    def unreachable(_: Any) -> Any:
        raise RuntimeError("the directory is unreachable")

    monkeypatch.setattr(ns.cm, "copy_table", unreachable)  # the directory's one door
    with pytest.raises(RuntimeError, match="unreachable"):
        ns.load_layers(list(PROMPT), match)
    assert pins_held(plane) == 0
    conn.shutdown()


def test_a_step_cancelled_between_groups_writes_nothing_more_and_lets_its_pins_go(
    plane: Plane, monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn, caches, ns, stored = engine(plane)
    entered, opened = hold_later_groups(monkeypatch)
    step(conn)
    conn.wait_for_layer_load(NAMES[0])
    assert entered.wait(BOUND_S) and pins_held(plane) == 3
    worker = conn._side_worker()
    assert worker._step is not None
    worker._cancel(worker._step, "late")  # as wait_layer past the bound
    opened.set()
    for name in NAMES:
        conn.wait_for_layer_load(name)
    report = end(conn)
    assert conn.get_block_ids_with_load_errors() == set(ENGINE_BLOCKS)
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", 0)]
    assert torch.equal(blocks_of(caches[0], list(ENGINE_BLOCKS)), stored[0])
    assert not caches[1].any() and not caches[2].any()  # nothing written after the cancel
    assert pins_held(plane) == 0
    conn.shutdown()


@pytest.mark.parametrize("order", list(PayloadOrder))
def test_groups_bring_the_stored_bytes_in_either_order_and_a_slot_reused_midway_counts_not(
    plane: Plane, order: PayloadOrder,
) -> None:
    layout = dataclasses.replace(LAYOUT, order=order)
    ns = namespace_client(plane, NODE, layout, f"t-{uuid.uuid4().hex[:6]}")
    stored = layout.random_kv(3 * T, seed=5)
    assert ns.store(list(PROMPT), stored).wait() == 3
    load = ns.load_layers(list(PROMPT))
    assert torch.equal(torch.cat([load.group(range(i, i + 1)) for i in range(3)]), stored)
    assert load.finish() == 3
    load = ns.load_layers(list(PROMPT))
    first = load.group(range(0, 1))
    # Block 1's lease ran out and its slot took another block's bytes before the next group.
    pins = ns.cm.plane.pin_prefix(ns.keys(list(PROMPT)), "test")
    payload = ns.cm.plane.payload(pins[1])
    payload[:] = np.frombuffer(layout.random_kv(T, seed=6).numpy().tobytes(), np.uint8)
    ns.cm.plane.unpin(pins)
    load.group(range(1, 3))
    assert torch.equal(first, stored[:1])
    assert load.finish() == 1  # block 1 failed its checksum: it and the rest are not counted
    assert pins_held(plane) == 0
