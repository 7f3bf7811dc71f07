"""``load_mode`` "async": a request's cached prefix lands on a thread while vLLM keeps the request
waiting (WAITING_FOR_REMOTE_KVS) and its steps go on; the load is over when ``get_finished``
names it, with every block that did not land in ``get_block_ids_with_load_errors``.

Both sides are the real connector, driven as vLLM's scheduler and model runner drive them,
against the in-process service (tests/unit/actors/plane.py) reached through ``GatedLink``, which
holds or fails the loader's calls as a service that hangs or dies would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from plane import Plane
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput
from vllm_plane import (
    BOUND_S,
    LAYOUT,
    NAMES,
    GatedLink,
    T,
    allocated,
    blocks_of,
    connector,
    paged_caches,
    plane_of,
    poll_finished,
    request,
    step_output,
)

from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_loads import AsyncLoads, Loaded
from cmx.connectors.vllm_meta import CMXStepMetadata, CMXWorkerReport, LoadSpec

PROMPT = tuple(range(900, 900 + 4 * T + 1))  # four full blocks and one token
BLOCKS = [5, 2, 4, 1]  # the engine's blocks of the request, in order
ASYNC = {"load_mode": "async", "gate": False, "lookup_wait_s": BOUND_S}


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path, link_type=GatedLink)
    yield p
    p.close()


def link(plane: Plane) -> GatedLink:
    assert isinstance(plane.link, GatedLink)
    return plane.link


def stored_prefix(worker: CMXConnector) -> torch.Tensor:
    """The service holds the prompt's first three blocks; their KV."""
    kv = LAYOUT.random_kv(3 * T, seed=11)
    ns = worker._side_worker().namespaces.get("")
    assert ns.store(list(PROMPT[:3 * T]), kv).wait() == 3
    return kv


def engine(plane: Plane, **extra: Any) -> tuple[CMXConnector, CMXConnector, list[torch.Tensor]]:
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, **ASYNC, **extra)
    worker = connector(plane, KVConnectorRole.WORKER, **ASYNC, **extra)
    caches = paged_caches()
    worker.register_kv_caches(dict(zip(NAMES, caches)))
    return scheduler, worker, caches


def plan_load(scheduler: CMXConnector, req_id: str = "r",
              blocks: list[int] = BLOCKS) -> CMXStepMetadata:
    """vLLM admits the request: asks, is told the load is asynchronous, allocates, builds the
    step's metadata (the request itself is not scheduled)."""
    req = request(req_id, PROMPT)
    scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (3 * T, True)
    scheduler.update_state_after_alloc(req, allocated(blocks), 3 * T)
    meta = scheduler.build_connector_meta(step_output())
    assert isinstance(meta, CMXStepMetadata)
    return meta


def run_step(worker: CMXConnector, meta: CMXStepMetadata,
             finished: set[str] | None = None) -> tuple[Any, ...]:
    """One step of the model runner with no request of this test scheduled."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    for name in NAMES:
        worker.wait_for_layer_load(name)  # nothing of this step waits for the load
    worker.wait_for_save()
    done = worker.get_finished(finished or set())
    errors = worker.get_block_ids_with_load_errors()
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return done, errors, report


def test_an_async_load_lands_while_steps_go_on_and_is_reported_received(plane: Plane) -> None:
    scheduler, worker, caches = engine(plane)
    stored = stored_prefix(worker)
    meta = plan_load(scheduler)
    assert meta.loads == [] and meta.async_loads == [
        LoadSpec("r", "", PROMPT[:3 * T], 0, 3 * T, (5, 2, 4))]

    link(plane).held = True  # the service has not answered yet
    done, errors, report = run_step(worker, meta)
    assert link(plane).entered.wait(BOUND_S)
    assert done == (None, None) and errors == set() and report is None
    assert not any(c.any() for c in caches)  # nothing is reported, nothing has landed

    link(plane).opened.set()
    assert poll_finished(worker) == {"r"}
    assert worker.get_block_ids_with_load_errors() == set()
    for layer in range(len(NAMES)):
        assert torch.equal(blocks_of(caches[layer], [5, 2, 4]), stored[layer])
    report = worker.build_connector_worker_meta()
    assert isinstance(report, CMXWorkerReport)
    assert [(x.req_id, x.asked_tokens, x.loaded_tokens) for x in report.loads] == [
        ("r", 3 * T, 3 * T)]
    stats = worker.get_kv_connector_stats()
    assert stats is not None and stats.data["loads"] == 1
    assert stats.data["loaded_tokens"] == 3 * T and stats.data["load_failed_tokens"] == 0

    scheduler.update_connector_output(KVConnectorOutput(finished_recving={"r"},
                                                        kv_connector_worker_meta=report))
    assert scheduler._side_scheduler().requests["r"].loading is False
    assert scheduler._side_scheduler().requests["r"].report["loaded_tokens"] == 3 * T
    scheduler.shutdown()
    worker.shutdown()


def test_an_abort_during_an_async_load_is_reported_at_once_and_writes_nothing(
    plane: Plane,
) -> None:
    scheduler, worker, caches = engine(plane, save_mode="async")
    stored_prefix(worker)
    meta = plan_load(scheduler)
    link(plane).held = True
    run_step(worker, meta)
    assert link(plane).entered.wait(BOUND_S)

    # vLLM aborts the waiting request: it keeps the blocks until the load is reported over,
    # so the connector must not keep them a second time.
    assert scheduler.request_finished(request("r", PROMPT), BLOCKS)[0] is False
    out = scheduler.build_connector_meta(step_output(finished=("r",)))
    assert isinstance(out, CMXStepMetadata) and out.held == []
    done, errors, report = run_step(worker, out, finished={"r"})
    assert done == (None, {"r"})  # reported in the step that told it, not after the load
    assert errors == {5, 2, 4}  # every block it promised, in the same pass
    assert isinstance(report, CMXWorkerReport) and report.loads[0].loaded_tokens == 0
    stats = worker.get_kv_connector_stats()
    assert stats is not None and stats.data["load_failed_tokens"] == 3 * T

    loads = worker._side_worker().loads
    threads = list(loads._pool._threads)  # type: ignore[attr-defined]
    link(plane).opened.set()  # the service answers after all: its blocks are not written
    worker.shutdown()
    for thread in threads:
        thread.join(BOUND_S)
        assert not thread.is_alive()
    assert loads.running == 0
    assert not any(c.any() for c in caches)
    assert worker.get_finished(set()) == (None, None)  # reported once
    scheduler.shutdown()


@pytest.mark.parametrize("trouble", ["dead", "hung"])
def test_a_service_that_fails_during_an_async_load_fails_its_blocks(
    plane: Plane, trouble: str,
) -> None:
    # "dead": its calls fail; "hung": they never answer. Either way the load ends by the load
    # bound, short here (a liveness bound, not a timing assertion).
    scheduler, worker, caches = engine(plane, load_timeout_s=0.2)
    stored_prefix(worker)
    meta = plan_load(scheduler)
    link(plane).dead = trouble == "dead"
    link(plane).held = trouble == "hung"
    (_, received), errors, _ = run_step(worker, meta)  # a dead service fails it at once
    if not received:
        received, errors = poll_finished(worker), worker.get_block_ids_with_load_errors()
    assert received == {"r"} and errors == {5, 2, 4}
    stats = worker.get_kv_connector_stats()
    assert stats is not None and stats.data["loads"] == 1
    assert stats.data["loaded_tokens"] == 0 and stats.data["load_failed_tokens"] == 3 * T
    threads = list(worker._side_worker().loads._pool._threads)  # type: ignore[attr-defined]
    link(plane).opened.set()
    worker.shutdown()
    for thread in threads:
        thread.join(BOUND_S)
        assert not thread.is_alive()
    assert not any(c.any() for c in caches)
    scheduler.shutdown()


def test_a_preempted_request_is_loaded_again_into_its_new_blocks(plane: Plane) -> None:
    scheduler, worker, caches = engine(plane)
    stored = stored_prefix(worker)
    (_, received), _, _ = run_step(worker, plan_load(scheduler))
    assert (received or poll_finished(worker)) == {"r"}
    scheduler.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    # The load is over: vLLM schedules the request from its 3 loaded blocks, then preempts it
    # (its blocks freed) and admits it again: it is asked again, and loads into new blocks.
    scheduler.build_connector_meta(step_output(new=(("r", BLOCKS, 3 * T, T + 1),)))
    scheduler.build_connector_meta(step_output(preempted=("r",)))
    meta = plan_load(scheduler, blocks=[0, 6, 7, 3])
    assert [x.block_ids for x in meta.async_loads] == [(0, 6, 7)]
    (_, received), _, _ = run_step(worker, meta)
    assert (received or poll_finished(worker)) == {"r"}
    for layer in range(len(NAMES)):
        assert torch.equal(blocks_of(caches[layer], [0, 6, 7]), stored[layer])
    scheduler.shutdown()
    worker.shutdown()


def test_a_load_cut_before_a_thread_took_it_fetches_nothing() -> None:
    # One loader thread, busy with A; B waits for it and is cut (its request aborted) before it
    # starts: B must not look up, pin or read anything once A's thread frees up.
    go, fetched = threading.Event(), []

    def fetch(spec: LoadSpec) -> Loaded:
        fetched.append(spec.req_id)
        go.wait(BOUND_S)
        return Loaded(spec, None, 0)

    loads = AsyncLoads(fetch, lambda layer, loaded: None, layers=2, bound_s=BOUND_S, threads=1)
    for req in ("A", "B"):
        loads.submit(LoadSpec(req, "", tuple(range(T)), 0, T, (0,)))
    ended = loads.poll(finished=["B"])
    assert [(e.spec.req_id, e.blocks) for e in ended] == [("B", 0)]
    go.set()
    while loads.running:
        loads.poll()
    loads.shutdown()
    assert fetched == ["A"]
