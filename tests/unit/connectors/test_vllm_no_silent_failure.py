"""A store the service did not commit is never reported as stored, and an engine whose blocks
do not fit the running service's slots does not start: it is refused with the number to set.

The service is the in-process plane (tests/unit/actors/plane.py); the stores go the real way
(grants, copies into DRAM slots, commits) and fail the ways they fail there: a slot too small
for the block, a commit whose leases ran out, a commit whose answer never came.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
import torch
from plane import Plane
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_plane import (
    LAYOUT,
    LEASE_S,
    NAMES,
    T,
    client_of,
    connector,
    paged_caches,
    plane_of,
)

from cmx.config import ServiceConfig
from cmx.connectors.paged import PagedLayout
from cmx.connectors.settings import ConnectorSettings, Namespaces
from cmx.connectors.vllm_meta import CMXStepMetadata, CMXWorkerReport, SaveSpec, StoreResult
from cmx.connectors.vllm_scheduler import SchedulerSide
from cmx.connectors.vllm_worker import WorkerSide
from cmx.doors import CommitStore, Pending, Request
from cmx.errors import LayoutMismatchError, UnavailableError
from cmx.links import LocalLink, _Answered

R = TypeVar("R")
PROMPT = tuple(range(700, 700 + 2 * T + 3))  # two full blocks and a partial one


class TroubledCommits(LocalLink):
    """The plane's link, where a store's commit can go wrong: "late" (its answer never comes,
    as a Ray call past its timeout) or "expired" (the store's leases end before it runs)."""

    trouble = ""
    plane: Plane | None = None

    def submit(self, name: str, request: Request[R]) -> Pending[R]:
        if isinstance(request, CommitStore) and self.trouble == "late":
            return Pending(request, _Answered(
                None, UnavailableError("a call did not answer: timed out")))
        if isinstance(request, CommitStore) and self.trouble == "expired":
            assert self.plane is not None
            self.plane.clock.advance(2 * LEASE_S)
        return super().submit(name, request)


def test_blocks_larger_than_the_running_services_slots_refuse_the_engine(tmp_path) -> None:
    plane = plane_of(tmp_path, block_bytes=4096)  # started by someone else, 4 KiB slots
    try:
        # The engine's own setting would have slots of 1 MiB: it is the running service's
        # slots that its blocks must fit.
        with pytest.raises(LayoutMismatchError, match=f"CMX_BLOCK_BYTES={LAYOUT.block_bytes}"):
            connector(plane, KVConnectorRole.SCHEDULER,
                      service={"block_bytes": 1 << 20, "call_timeout_s": 5.0})
    finally:
        plane.close()


def test_blocks_that_fit_the_running_services_slots_start_whatever_the_setting(tmp_path) -> None:
    plane = plane_of(tmp_path, block_bytes=8192)
    try:
        conn = connector(plane, KVConnectorRole.SCHEDULER,
                         service={"block_bytes": 4096, "call_timeout_s": 5.0})
        assert conn._cm.config.block_bytes == 8192
        conn.shutdown()
    finally:
        plane.close()


@pytest.fixture
def troubled(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path, link_type=TroubledCommits)
    p.link.plane = p  # type: ignore[attr-defined]
    yield p
    p.close()


def store_one_step(namespaces: Namespaces) -> tuple[list[StoreResult], dict[str, Any], Any]:
    """One step that stores the prompt's two full blocks, as vLLM drives both sides; returns
    how the stores ended, the request's report to vLLM, and the worker's counters."""
    settings = ConnectorSettings(load_timeout_s=30.0)
    scheduler = SchedulerSide(settings, namespaces, T)
    worker = WorkerSide(settings, namespaces, NAMES, PagedLayout.VLLM_CPU)
    caches = [torch.randn_like(c) for c in paged_caches()]
    worker.register(dict(zip(NAMES, caches)))
    scheduler.track("r", PROMPT, None)
    worker.begin_step(CMXStepMetadata(saves=[SaveSpec("r", "", PROMPT[:2 * T], 0, 2 * T,
                                                      (3, 6))]))
    for name, cache in zip(NAMES, caches):
        worker.save_layer(name, cache)
    worker.end_step()
    worker.shutdown()  # waits for the store thread: the store has ended
    report = worker.take_report()
    assert report is not None and report.handed == {"r": 2 * T}
    sent = scheduler.finished("r")  # the request ends in this step, then the report comes
    assert sent is not None
    scheduler.take_report(report)
    scheduler.shutdown()
    return report.stores, sent, worker.take_stats()


@pytest.mark.parametrize("trouble,committed", [("", 2), ("expired", 0), ("late", 0)])
def test_only_committed_blocks_are_reported_stored(
    troubled: Plane, trouble: str, committed: int,
) -> None:
    troubled.link.trouble = trouble  # type: ignore[attr-defined]
    cm = client_of(troubled, troubled.config)
    stores, sent, stats = store_one_step(Namespaces(cm, "m", LAYOUT, "w"))
    failed = 2 * T - committed * T
    assert stores == [StoreResult("r", 2 * T, committed * T, failed)]
    assert sent.get("stored_tokens", 0) == committed * T
    assert sent.get("store_failed_tokens", 0) == failed
    assert "store_pending_tokens" not in sent
    assert stats.data["stored_tokens"] == committed * T
    assert stats.data["store_failed_tokens"] == failed
    found = Namespaces(cm, "m", LAYOUT, "w").get("").lookup(list(PROMPT)).num_tokens
    assert found == committed * T  # what was reported stored is what the service holds


def test_a_store_into_slots_too_small_is_reported_failed_not_stored(tmp_path) -> None:
    # A service restarted with smaller slots after the engine started: the copy into a slot
    # fails where the store runs.
    plane = plane_of(tmp_path, block_bytes=4096)
    try:
        cm = client_of(plane, ServiceConfig(block_bytes=1 << 20, call_timeout_s=5.0))
        stores, sent, stats = store_one_step(Namespaces(cm, "m", LAYOUT, "w"))
        assert stores == [StoreResult("r", 2 * T, 0, 2 * T)]
        assert "stored_tokens" not in sent and sent["store_failed_tokens"] == 2 * T
        assert stats.data["stored_tokens"] == 0
    finally:
        plane.close()


def test_a_store_still_running_when_its_request_ends_is_reported_pending() -> None:
    class Opened(Namespaces):
        def __init__(self) -> None:
            self.layout = LAYOUT
            self._open = {}

        def get(self, salt: str) -> Any:
            return None

    s = SchedulerSide(ConnectorSettings(), Opened(), T)
    s.track("r", PROMPT, None)
    s.take_report(CMXWorkerReport(handed={"r": 2 * T}))
    sent = s.finished("r")
    assert sent == {"store_pending_tokens": 2 * T}
    s.take_report(CMXWorkerReport(stores=[StoreResult("r", 2 * T, T, 0)]))
    assert sent == {"stored_tokens": T}  # one block was already held: not stored again
    s.shutdown()
