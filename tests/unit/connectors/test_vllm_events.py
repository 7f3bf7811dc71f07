"""KV events for routers: the connector announces a save's blocks (``BlockStored``, with vLLM's
own block hashes of the request) once the service committed all of them, never a save it did
not commit, and ``AllBlocksCleared`` after ``reset_cache``.

Both sides of the real connector run against the in-process plane; the request is a real vLLM
``Request`` whose block hashes come from vLLM's own hasher.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from plane import Plane
from test_vllm_no_silent_failure import TroubledCommits
from vllm import SamplingParams
from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request
from vllm_plane import NAMES, T, allocated, connector, paged_caches, plane_of, step_output

from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_events import KEEP, StoreEvents
from cmx.connectors.vllm_meta import CMXWorkerReport

PROMPT = list(range(900, 900 + 2 * T + 3))  # two full blocks and a partial one


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path, link_type=TroubledCommits)
    p.link.plane = p  # type: ignore[attr-defined]
    yield p
    p.close()


def vllm_request(req_id: str) -> Request:
    init_none_hash(sha256)
    return Request(req_id, PROMPT, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(T, sha256))


def store_a_prompt(plane: Plane, reset_first: bool = False) -> tuple[CMXConnector, Request]:
    """One step that computes and stores the prompt's two full blocks, as vLLM drives both
    sides; the workers' report has reached the scheduler side when it returns.
    ``reset_first``: ``reset_cache`` once the request is known, before its step."""
    scheduler = connector(plane, KVConnectorRole.SCHEDULER)
    worker = connector(plane, KVConnectorRole.WORKER)
    caches = [torch.randn_like(c) for c in paged_caches()]
    worker.register_kv_caches(dict(zip(NAMES, caches)))
    request = vllm_request("r")
    assert scheduler.get_num_new_matched_tokens(request, 0) in ((0, False), (None, False))
    scheduler.update_state_after_alloc(request, allocated([3, 6, 1]), 0)
    if reset_first:
        assert scheduler.reset_cache() is True
    meta = scheduler.build_connector_meta(step_output(new=(("r", [3, 6, 1], 0, len(PROMPT)),)))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    for name, cache in zip(NAMES, caches):
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, cache, None)
    worker.wait_for_save()
    worker.shutdown()  # waits for the store thread: the store has ended
    report = worker.build_connector_worker_meta()
    assert isinstance(report, CMXWorkerReport) and report.stores
    scheduler._side_scheduler().take_report(report)
    return scheduler, request


def test_a_committed_save_is_announced_with_vllms_block_hashes(plane: Plane) -> None:
    scheduler, request = store_a_prompt(plane)
    events = list(scheduler.take_events())
    assert events == [BlockStored(
        block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[:2]],
        parent_block_hash=None, token_ids=PROMPT[:2 * T],
        block_size=T, lora_id=None, medium=MEDIUM_CPU, lora_name=None, ownership="cmx")]
    assert list(scheduler.take_events()) == []  # each event is taken once
    assert scheduler.reset_cache() is True
    assert list(scheduler.take_events()) == [AllBlocksCleared()]
    scheduler.shutdown()


@pytest.mark.parametrize("trouble", ["expired", "late"])
def test_a_save_the_service_did_not_commit_is_not_announced(plane: Plane, trouble: str) -> None:
    plane.link.trouble = trouble  # type: ignore[attr-defined]
    scheduler, _ = store_a_prompt(plane)
    assert list(scheduler.take_events()) == []
    scheduler.shutdown()


def test_a_later_save_names_its_parent_block_and_saves_never_ended_are_forgotten() -> None:
    events = StoreEvents(block_size=4)
    hashes = [BlockHash(bytes([i]) * 32) for i in range(3)]
    events.planned("r", hashes, list(range(12)), 4, 12)
    events.ended("r", 4, 8, 8)
    (stored,) = events.take()
    external = [maybe_convert_block_hash(h) for h in hashes]  # as vLLM publishes its own
    assert stored.block_hashes == external[1:] and stored.parent_block_hash == external[0]
    assert stored.token_ids == list(range(4, 12))
    events.planned("r", [], list(range(8)), 0, 8)  # no hashes (prefix caching off)
    events.ended("r", 0, 8, 8)
    assert events.take() == []
    for i in range(KEEP + 1):
        events.planned(f"q{i}", hashes, list(range(12)), 0, 4)
    events.ended("q0", 0, 4, 4)  # its save was planned longest ago: forgotten
    events.ended(f"q{KEEP}", 0, 4, 4)
    assert len(events.take()) == 1


def test_a_save_of_a_request_known_before_a_reset_is_not_announced_after_it(
    plane: Plane,
) -> None:
    # Its blocks go to the namespaces of before the reset, which no later request looks in.
    scheduler, _ = store_a_prompt(plane, reset_first=True)
    assert list(scheduler.take_events()) == [AllBlocksCleared()]
    scheduler.shutdown()


def test_a_store_under_way_says_nothing_of_a_later_requests_blocks_under_the_same_id() -> None:
    events = StoreEvents(block_size=4)
    earlier, later = ([BlockHash(bytes([n, i]) * 16) for i in range(2)] for n in (1, 2))
    events.planned("r", earlier, list(range(8)), 0, 8)
    events.planned("r", later, list(range(100, 108)), 0, 8)  # vLLM's caller reused the id
    events.ended("r", 0, 8, 8)  # one of the two stores committed: which one is not known
    events.ended("r", 0, 8, 0)
    assert events.take() == []
    events.planned("r", earlier, list(range(8)), 0, 8)
    events.cleared()  # reset_cache while its store is under way
    events.planned("r", later, list(range(100, 108)), 0, 8)
    events.ended("r", 0, 8, 8)
    assert events.take() == [AllBlocksCleared()]
    events.ended("r", 0, 8, 8)
    events.planned("r", earlier, list(range(8)), 0, 8)  # the same blocks twice: either says
    events.planned("r", earlier, list(range(8)), 0, 8)
    events.ended("r", 0, 8, 0)
    events.ended("r", 0, 8, 8)
    (stored,) = events.take()
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in earlier]
