"""CMXConnector's worker hooks, called in the order vLLM's model runner calls them in a step
of piecewise CUDA graphs, on CPU tensors in vLLM's CPU paged layout, against an in-process
service: each layer's loaded bytes are in the paged cache when its wait returns.

With full CUDA graphs the per-layer hooks are not called at all on replay, so the connector
must make vLLM capture piecewise graphs: ``requires_piecewise_for_cudagraph``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from plane import Plane
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_plane import (
    BOUND_S,
    LAYOUT,
    NAMES,
    T,
    blocks_of,
    connector,
    paged_caches,
    plane_of,
)

from cmx.connectors.paged import PagedLayout, scatter_layer
from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_meta import (
    CMXStepMetadata,
    CMXWorkerReport,
    LoadSpec,
    SaveSpec,
    StoreResult,
)

PROMPT = tuple(range(500, 500 + 4 * T))  # four full blocks


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path)
    yield p
    p.close()


@pytest.mark.parametrize("extra", [{}, {"gate": False, "ray_address": "10.0.0.5:6379"}])
def test_the_connector_asks_for_piecewise_cuda_graphs(extra: dict[str, object]) -> None:
    assert CMXConnector.requires_piecewise_for_cudagraph(extra) is True


def test_a_step_in_cuda_graph_order_has_each_layer_in_place_when_its_wait_returns(
    plane: Plane,
) -> None:
    conn = connector(plane, KVConnectorRole.WORKER)
    caches = paged_caches()
    conn.register_kv_caches(dict(zip(NAMES, caches)))
    ns = conn._side_worker().namespaces.get("")
    stored = LAYOUT.random_kv(3 * T, seed=7)
    assert ns.store(list(PROMPT[:3 * T]), stored).wait() == 3  # the service holds 3 blocks

    # The scheduler's plan: load the three cached blocks into engine blocks 5, 2, 4; compute
    # the fourth into block 1 and store it.
    meta = CMXStepMetadata(loads=[LoadSpec("r", "", PROMPT[:3 * T], 0, 3 * T, (5, 2, 4))],
                           saves=[SaveSpec("r", "", PROMPT, 3 * T, 4 * T, (1,))],
                           computed=[(3 * T, 4 * T)])
    computed = LAYOUT.random_kv(T, seed=8)
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)  # type: ignore[arg-type]
    for layer, (name, cache) in enumerate(zip(NAMES, caches)):
        conn.wait_for_layer_load(name)
        assert torch.equal(blocks_of(cache, [5, 2, 4]), stored[layer])
        write_block(cache, 1, computed[layer])  # the layer's attention writes the new block
        conn.save_kv_layer(name, cache, None)
    conn.wait_for_save()
    assert conn.get_finished(set()) == (None, None)
    assert conn.get_block_ids_with_load_errors() == set()
    stats = conn.get_kv_connector_stats()
    report = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()

    assert isinstance(report, CMXWorkerReport)
    assert [(x.req_id, x.loaded_tokens) for x in report.loads] == [("r", 3 * T)]
    assert report.handed == {"r": T}
    assert stats is not None and stats.data["loaded_tokens"] == 3 * T

    # A decode step next: nothing to load or store, the hooks change nothing.
    before = [c.clone() for c in caches]
    conn.bind_connector_metadata(CMXStepMetadata(computed=[(4 * T, 4 * T + 1)]))
    conn.start_load_kv(None)  # type: ignore[arg-type]
    for name, cache in zip(NAMES, caches):
        conn.wait_for_layer_load(name)
        conn.save_kv_layer(name, cache, None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert all(torch.equal(a, b) for a, b in zip(before, caches))

    wait_stored(ns, 4 * T)
    got = ns.load(list(PROMPT))
    assert torch.equal(got[:, :, :, :3 * T], stored)
    assert torch.equal(got[:, :, :, 3 * T:], computed)
    conn.shutdown()  # waits for the store thread: how the store ended is known now
    later = conn.build_connector_worker_meta()
    ended = report.stores + (later.stores if isinstance(later, CMXWorkerReport) else [])
    assert ended == [StoreResult("r", T, T, 0)]  # in the step's report, or the next one
    more = conn.get_kv_connector_stats()
    total = stats.aggregate(more) if more is not None else stats
    assert total.data["stored_tokens"] == T and total.data["store_failed_tokens"] == 0


def write_block(cache: torch.Tensor, block: int, kv: torch.Tensor) -> None:
    """Write one block's KV ``[2, heads, T, dim]`` into the paged cache, as attention does."""
    scatter_layer(cache, PagedLayout.VLLM_CPU, [block], kv.contiguous())


def wait_stored(ns: object, tokens: int) -> None:
    """Stores run behind the step: wait (bounded) until the service answers ``tokens``."""
    deadline = time.monotonic() + BOUND_S
    while ns.lookup(list(PROMPT)).num_tokens < tokens:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the stored block was never committed"
        time.sleep(0.01)

