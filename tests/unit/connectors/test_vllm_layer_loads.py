"""Sync loads in groups of layers (``load_layer_groups``): layer 0's wait returns once layer 0's
group has landed, while the later groups are still being fetched from the service; the load
counts only the blocks every group brought whole and verified.

The service is the in-process plane; the prefix is held on its NVMe tier (each group is then a
selection fetched through the agent: ``load_slices``) or in its DRAM (each group copied out of
the pinned shared memory, its checksum known at the end).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from plane import Plane
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_plane import BOUND_S, LAYOUT, NAMES, NODE, T, blocks_of, connector, paged_caches, plane_of

from cmx.client.layer_loads import layer_groups
from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_meta import CMXStepMetadata, CMXWorkerReport, LoadSpec
from cmx.links import LocalLink
from cmx.tiers import Tier

PROMPT = tuple(range(700, 700 + 3 * T))  # three full blocks
ENGINE_BLOCKS = (5, 2, 4)


class HeldSlices(LocalLink):
    """The plane's link; once ``hold`` is set, the loader's second and later selection fetches
    (``load_slices``: the groups after the first) wait for ``opened``."""

    def __init__(self, targets: Any) -> None:
        super().__init__(targets)
        self.hold = False
        self.fetches = 0
        self.entered = threading.Event()  # a later group's fetch is waiting
        self.opened = threading.Event()
        self.meanwhile: Any = None  # run once, while the first held fetch waits

    def call(self, name: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        if self.hold and method == "load_slices":
            self.fetches += 1
            if self.fetches > 1:
                if self.meanwhile is not None:
                    self.meanwhile, run = None, self.meanwhile
                    run()
                self.entered.set()
                assert self.opened.wait(BOUND_S)
        return super().call(name, method, *args, timeout_s=timeout_s)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path, link_type=HeldSlices, placement="write_through")
    yield p
    p.close()


def engine(plane: Plane) -> tuple[CMXConnector, list[torch.Tensor], Any, torch.Tensor]:
    """A worker-side connector loading in three groups (one layer each), and the prefix it
    finds stored."""
    conn = connector(plane, KVConnectorRole.WORKER, load_layer_groups=3)
    caches = paged_caches()
    conn.register_kv_caches(dict(zip(NAMES, caches)))
    ns = conn._side_worker().namespaces.get("")
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


def test_layer_zero_is_ready_while_the_later_groups_are_still_being_fetched(
    plane: Plane,
) -> None:
    conn, caches, ns, stored = engine(plane)
    only_on_nvme(plane, ns.keys(list(PROMPT)))
    link = plane.link
    link.hold = True
    step(conn)
    conn.wait_for_layer_load(NAMES[0])
    assert link.entered.wait(BOUND_S)  # layer 1's group is being fetched: held in the service
    assert torch.equal(blocks_of(caches[0], list(ENGINE_BLOCKS)), stored[0])
    assert not caches[1].any() and not caches[2].any()
    link.opened.set()
    for layer, name in enumerate(NAMES):
        conn.wait_for_layer_load(name)
        assert torch.equal(blocks_of(caches[layer], list(ENGINE_BLOCKS)), stored[layer])
    report = end(conn)
    assert conn.get_block_ids_with_load_errors() == set()
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", 3 * T)]
    conn.shutdown()


def test_a_block_gone_between_two_groups_is_recomputed_and_the_rest_counts(
    plane: Plane,
) -> None:
    conn, caches, ns, stored = engine(plane)
    keys = ns.keys(list(PROMPT))
    only_on_nvme(plane, keys)
    link = plane.link
    link.hold = True
    link.meanwhile = lambda: plane.tiers[(NODE, Tier.NVME)].evict([keys[2]])
    link.opened.set()
    step(conn)
    for name in NAMES:
        conn.wait_for_layer_load(name)
    report = end(conn)
    assert conn.get_block_ids_with_load_errors() == {ENGINE_BLOCKS[2]}  # layer 0 had it
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", 2 * T)]
    for layer in range(len(NAMES)):
        assert torch.equal(blocks_of(caches[layer], list(ENGINE_BLOCKS[:2])),
                           stored[layer][:, :, : 2 * T])
    conn.shutdown()


def test_a_block_in_memory_found_corrupt_at_the_end_is_recomputed_and_quarantined(
    plane: Plane,
) -> None:
    conn, caches, ns, stored = engine(plane)
    keys = ns.keys(list(PROMPT))
    node_plane = ns.cm.plane
    pins = node_plane.pin_prefix(keys, "test")
    assert [p.tier for p in pins] == [Tier.DRAM] * 3
    payload = node_plane.payload(pins[1])
    payload[-1] = np.uint8(payload[-1] ^ 0xFF)  # the last layer's bytes: seen only at the end
    node_plane.unpin(pins)
    step(conn)
    conn.wait_for_layer_load(NAMES[0])
    assert torch.equal(blocks_of(caches[0], list(ENGINE_BLOCKS)), stored[0])  # not yet known
    for name in NAMES[1:]:
        conn.wait_for_layer_load(name)
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
