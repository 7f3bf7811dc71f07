"""With host caches the gather thread makes a save's first service call itself (its DRAM
slots: ``StorePipeline._save_direct``) before it reads a block, and vLLM keeps a finished
request's blocks until that copy is over (``Gatherer.idle``). A service that stops answering
must not hold vLLM's blocks: past ``DIRECT_GRANT_S`` the save goes through a host tensor, and
the blocks are vLLM's again as through the host-tensor path."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
import torch
from plane import Plane
from test_vllm_async_saves import forward
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_plane import BOUND_S, NAMES, T, connector, paged_caches, plane_of, request, step_output

from cmx.connectors.vllm_meta import CMXStepMetadata
from cmx.doors import Request
from cmx.errors import UnavailableError
from cmx.links import LocalLink

R = TypeVar("R")
PROMPT = tuple(range(500, 500 + 2 * T + 3))
FREE_WITHIN_S = 2.0  # the blocks of a finished request are vLLM's again within this


class StalledLink(LocalLink):
    """Calls made on the gather thread wait for ``opened`` while ``held``: a service that
    stopped answering, each call bounded by its own timeout as over Ray."""

    def __init__(self, targets: Any) -> None:
        super().__init__(targets)
        self.held = False
        self.entered = threading.Event()
        self.opened = threading.Event()

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if self.held and threading.current_thread().name.startswith("cmx-gather"):
            self.entered.set()
            if not self.opened.wait(timeout_s or BOUND_S):
                raise UnavailableError(f"{name}.{request.method} did not answer")
        return super().call(name, request, timeout_s=timeout_s)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path, link_type=StalledLink)
    yield p
    p.close()


@pytest.mark.parametrize("direct", [False, True], ids=["through-host-tensor", "direct"])
def test_a_stalled_service_does_not_hold_a_finished_requests_blocks(
        plane: Plane, direct: bool) -> None:
    link = plane.link
    assert isinstance(link, StalledLink)
    settings = {"save_mode": "async", "gate": False}
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, **settings)
    worker = connector(plane, KVConnectorRole.WORKER, **settings)
    caches = [torch.randn_like(c) for c in paged_caches()]
    worker.register_kv_caches(dict(zip(NAMES, caches)))
    worker._side_worker().stores.direct(direct)
    try:
        link.held = True  # the service stops answering the gather thread
        scheduler.on_new_request(request("r", PROMPT))
        deadline = time.monotonic() + BOUND_S
        while scheduler.get_num_new_matched_tokens(request("r", PROMPT), 0) != (0, False):
            assert time.monotonic() < deadline  # the lookup is answered (a miss)
            time.sleep(0.01)
        meta = scheduler.build_connector_meta(
            step_output(new=(("r", [3, 6, 1], 0, len(PROMPT)),)))
        assert isinstance(meta, CMXStepMetadata) and meta.saves
        forward(worker, meta, caches)
        hold, _ = scheduler.request_finished(request("r", PROMPT), [3, 6, 1])
        assert hold is True  # vLLM keeps the blocks until the worker says "sending"
        meta = scheduler.build_connector_meta(step_output(finished=("r",)))
        forward(worker, meta, caches, finished={"r"})
        deadline = time.monotonic() + FREE_WITHIN_S
        sending: set[str] = set()
        while time.monotonic() < deadline and not sending:
            sending = worker.get_finished(set())[0] or set()
            time.sleep(0.01)
        assert sending == {"r"}, (
            f"vLLM's blocks of a finished request still held after {FREE_WITHIN_S}s: the "
            f"gather thread waits on the service (entered={link.entered.is_set()})")
    finally:
        link.opened.set()
        worker.shutdown()
        scheduler.shutdown()
