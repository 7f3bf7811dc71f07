"""``save_mode`` "async": the blocks a step completed are copied out after the step, on the
gather thread, within a staging budget; vLLM keeps a finished request's blocks until the copy
is done, and a preempted request's copies are done (or cancelled) before its blocks are reused.

Both sides are the real connector against the in-process service (tests/unit/actors/plane.py);
``HeldGatherer`` holds each copy until a test lets it go, as a busy gather thread would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

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
    poll_finished,
    request,
    step_output,
)

from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_gather import Gatherer
from cmx.connectors.vllm_meta import CMXStepMetadata, CMXWorkerReport, SaveSpec, StoreResult

PROMPT = tuple(range(300, 300 + 2 * T + 3))  # two full blocks and a partial one


class HeldGatherer(Gatherer):
    """Starts each copy only once ``go`` is set; counts the copies that read the cache."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.go = threading.Event()
        self.reads = 0

    def _copy(self, copy: Any, caches: list[Any]) -> None:
        assert self.go.wait(BOUND_S)
        super()._copy(copy, caches)

    def _gather(self, save: SaveSpec, caches: list[Any]) -> Any:
        self.reads += 1
        return super()._gather(save, caches)

    def _copy_direct(self, direct: Any, copy: Any, caches: list[Any]) -> None:
        def counted(save: SaveSpec, source: Any) -> bool:
            self.reads += 1
            return bool(direct(save, source))

        super()._copy_direct(counted, copy, caches)


@pytest.fixture(params=[False, True], ids=["through-host-tensor", "direct"])
def plane(tmp_path, request: pytest.FixtureRequest) -> Iterator[Plane]:
    """Each test twice: the copy through a host tensor (as from a GPU cache), and straight
    from the host paged cache into the service's DRAM slots (``Gatherer.direct``)."""
    p = plane_of(tmp_path)
    p.direct_saves = request.param  # type: ignore[attr-defined]
    yield p
    p.close()


def engine(plane: Plane, **extra: Any
           ) -> tuple[CMXConnector, CMXConnector, HeldGatherer, list[torch.Tensor]]:
    settings = {"save_mode": "async", "gate": False, **extra}
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, **settings)
    worker = connector(plane, KVConnectorRole.WORKER, **settings)
    caches = [torch.randn_like(c) for c in paged_caches()]
    worker.register_kv_caches(dict(zip(NAMES, caches)))
    side = worker._side_worker()
    stores = side.stores
    stores.gatherer = HeldGatherer(side.layout, side.paged, side.settings.staging_bytes,
                                   stores._gathered)
    stores.direct(plane.direct_saves)  # type: ignore[attr-defined]
    return scheduler, worker, stores.gatherer, caches


def forward(worker: CMXConnector, meta: Any, caches: list[torch.Tensor],
            finished: set[str] | None = None) -> tuple[Any, ...]:
    """One step of the model runner: the layers' hooks, then what it asks after the forward."""
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    for name, cache in zip(NAMES, caches):
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, cache, None)
    worker.wait_for_save()
    done = worker.get_finished(finished or set())
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return done, report


def test_a_save_is_copied_after_its_step_and_vllm_keeps_the_blocks_until_then(
    plane: Plane,
) -> None:
    scheduler, worker, gatherer, caches = engine(plane)
    scheduler.on_new_request(request("r", PROMPT))
    assert scheduler.get_num_new_matched_tokens(request("r", PROMPT), 0) == (0, False)
    meta = scheduler.build_connector_meta(step_output(new=(("r", [3, 6, 1], 0, len(PROMPT)),)))
    assert isinstance(meta, CMXStepMetadata)
    assert meta.saves == [SaveSpec("r", "", PROMPT[:2 * T], 0, 2 * T, (3, 6))]
    done, report = forward(worker, meta, caches)  # returns with the copy not even started
    assert gatherer.reads == 0 and done == (None, None)
    assert isinstance(report, CMXWorkerReport) and report.handed == {"r": 2 * T}
    expected = [blocks_of(c, [3, 6]).clone() for c in caches]

    # The request finishes in that step: vLLM must keep its blocks for the copy.
    hold, _ = scheduler.request_finished(request("r", PROMPT), [3, 6, 1])
    assert hold is True
    meta = scheduler.build_connector_meta(step_output(finished=("r",)))
    assert isinstance(meta, CMXStepMetadata) and meta.held == ["r"]
    done, _ = forward(worker, meta, caches, finished={"r"})
    assert done == (None, None)  # the copy has not run: the blocks stay vLLM's to keep

    gatherer.go.set()
    assert poll_finished(worker, sending=True) == {"r"}  # now vLLM frees them
    assert gatherer.reads == 1
    worker.shutdown()  # the store has ended
    later = worker.build_connector_worker_meta()
    assert isinstance(later, CMXWorkerReport)
    assert later.stores == [StoreResult("r", 2 * T, 2 * T, 0)]
    got = worker._side_worker().namespaces.get("").load(list(PROMPT[:2 * T]))
    for layer in range(len(NAMES)):
        assert torch.equal(got[layer], expected[layer])
    assert gatherer.used_bytes == 0
    assert worker.get_finished(set()) == (None, None)  # named once
    scheduler.shutdown()


def test_saves_past_the_staging_budget_are_dropped_and_counted_and_the_step_goes_on(
    plane: Plane,
) -> None:
    scheduler, worker, gatherer, caches = engine(plane, staging_bytes=LAYOUT.block_bytes)
    meta = CMXStepMetadata(saves=[SaveSpec("a", "", PROMPT[:T], 0, T, (0,)),
                                  SaveSpec("b", "", PROMPT[:T], 0, T, (2,))])
    _, report = forward(worker, meta, caches)  # the gather thread is held: the step is not
    assert isinstance(report, CMXWorkerReport)
    assert report.handed == {"a": T} and report.dropped == {"b": T}
    stats = worker.get_kv_connector_stats()
    assert stats is not None and stats.data["store_dropped_tokens"] == T
    gatherer.go.set()
    worker.shutdown()
    assert gatherer.reads == 1 and gatherer.used_bytes == 0
    scheduler.shutdown()


@pytest.mark.parametrize("copied", [True, False])
def test_a_preempted_requests_copy_never_reads_blocks_vllm_reused(
    plane: Plane, copied: bool,
) -> None:
    # ``copied``: the gather thread gets to it before the preemption's step; else it is still
    # held when that step starts, past the bound (short: a liveness bound), and cancelled.
    scheduler, worker, gatherer, caches = engine(plane, load_timeout_s=BOUND_S if copied
                                                 else 0.2)
    save = SaveSpec("r", "", PROMPT[:T], 0, T, (4,))
    forward(worker, CMXStepMetadata(saves=[save]), caches)
    before = [blocks_of(c, [4]).clone() for c in caches]
    if copied:
        gatherer.go.set()
    meta = scheduler.build_connector_meta(step_output(preempted=("r",)))
    assert isinstance(meta, CMXStepMetadata) and meta.preempted == ["r"]
    worker.handle_preemptions(meta)  # once it returns, vLLM writes the freed blocks
    for cache in caches:
        cache.zero_()
    gatherer.go.set()
    worker.shutdown()
    report = worker.build_connector_worker_meta()
    assert isinstance(report, CMXWorkerReport)
    assert gatherer.reads == (1 if copied else 0)
    assert report.stores == [StoreResult("r", T, T, 0) if copied else StoreResult("r", T, 0, T)]
    if copied:  # what was stored is the block before vLLM reused it
        got = worker._side_worker().namespaces.get("").load(list(PROMPT[:T]))
        for layer in range(len(NAMES)):
            assert torch.equal(got[layer], before[layer])
    scheduler.shutdown()


def test_only_requests_that_saved_hold_their_blocks(plane: Plane) -> None:
    scheduler, worker, _, _ = engine(plane)
    scheduler.on_new_request(request("quiet", PROMPT[:3]))
    assert scheduler.request_finished(request("quiet", PROMPT[:3]), [0])[0] is False
    sync = connector(plane, KVConnectorRole.SCHEDULER, gate=False)
    sync.on_new_request(request("s", PROMPT))
    sync.build_connector_meta(step_output(new=(("s", [3, 6, 1], 0, len(PROMPT)),)))
    assert sync.request_finished(request("s", PROMPT), [3, 6, 1])[0] is False
    for conn in (scheduler, worker, sync):
        conn.shutdown()


def test_a_save_larger_than_the_whole_budget_is_taken_when_nothing_else_is_staged(
    plane: Plane,
) -> None:
    # A long prompt's one step can hold more blocks than the budget: dropped every time, such a
    # prompt would never be stored. Taken alone, it is; the next waits for room.
    scheduler, worker, gatherer, caches = engine(plane, staging_bytes=LAYOUT.block_bytes)
    meta = CMXStepMetadata(saves=[SaveSpec("a", "", PROMPT[:2 * T], 0, 2 * T, (0, 1)),
                                  SaveSpec("b", "", PROMPT[:T], 0, T, (2,))])
    _, report = forward(worker, meta, caches)
    assert isinstance(report, CMXWorkerReport)
    assert report.handed == {"a": 2 * T} and report.dropped == {"b": T}
    gatherer.go.set()
    worker.shutdown()
    assert gatherer.reads == 1 and gatherer.used_bytes == 0
    scheduler.shutdown()


def test_a_direct_copy_cut_by_a_preemption_reads_nothing_after_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The direct copy of two blocks is held before its second block while a preemption's
    step waits past its bound: the gate closes, the second block is never read, and the
    store is counted failed, nothing of it committed."""
    from cmx.connectors.paged import PagedSource

    plane = plane_of(tmp_path)  # the gate guards direct copies: this one only
    plane.direct_saves = True  # type: ignore[attr-defined]
    scheduler, worker, gatherer, caches = engine(plane, load_timeout_s=0.2)
    reading, resume = threading.Event(), threading.Event()
    copy_block = PagedSource.copy_block

    def held(self: PagedSource, i: int, slot: Any) -> Any:
        if i == 1:
            reading.set()
            assert resume.wait(BOUND_S)
        return copy_block(self, i, slot)

    monkeypatch.setattr(PagedSource, "copy_block", held)
    save = SaveSpec("r", "", PROMPT[:2 * T], 0, 2 * T, (4, 5))
    forward(worker, CMXStepMetadata(saves=[save]), caches)
    gatherer.go.set()
    assert reading.wait(BOUND_S)  # block 0 copied, block 1 not yet read
    meta = scheduler.build_connector_meta(step_output(preempted=("r",)))
    worker.handle_preemptions(meta)  # past the bound: the copy's gate closes
    for cache in caches:
        cache.zero_()  # vLLM reuses the blocks
    resume.set()
    worker.shutdown()
    report = worker.build_connector_worker_meta()
    assert isinstance(report, CMXWorkerReport)
    assert report.stores == [StoreResult("r", 2 * T, 0, 2 * T)]
    ns = worker._side_worker().namespaces.get("")
    assert ns.lookup(list(PROMPT[:2 * T])).num_tokens == 0
    assert gatherer.used_bytes == 0
    scheduler.shutdown()
    plane.close()
