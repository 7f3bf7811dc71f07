"""Prefill and decode on different engines: the producer's answer says how many of the
prompt's tokens it stored (``expect_tokens``), and a consumer handed that waits, bounded, for
the store to commit instead of missing it. Both sides are the real connector, against the
in-process service (tests/unit/actors/plane.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from plane import Plane
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_plane import BOUND_S, LAYOUT, T, connector, plane_of, request, step_output

from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_meta import CMXWorkerReport, StoreResult
from cmx.connectors.vllm_requests import RequestOptions
from cmx.connectors.vllm_scheduler import LOOK_AGAIN_S

PROMPT = tuple(range(700, 700 + 4 * T + 1))  # four full blocks and one token
WHOLE = 4 * T  # what a producer of this prompt stores
SETTINGS = {"gate": False, "lookup_wait_s": BOUND_S}  # every lookup answered in its call


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path)
    yield p
    p.close()


def consumer_request(expect: int) -> Any:
    """A request as a proxy hands it on: with the producer's report."""
    req = request("r", PROMPT)
    req.kv_transfer_params = {"cmx": {"expect_tokens": expect, "stored_tokens": expect,
                                      "lookup_tokens": 0, "plan": "computed"}}
    return req


def produce(plane: Plane) -> None:
    """The producer's store commits."""
    worker = connector(plane, KVConnectorRole.WORKER)
    ns = worker._side_worker().namespaces.get("").whole
    assert ns.store(list(PROMPT[:WHOLE]), LAYOUT.random_kv(WHOLE, seed=5)).wait() == 4


def asked_until_known(scheduler: CMXConnector, req: Any) -> int:
    """vLLM asks again each step while the answer is "not known yet" (bounded)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        tokens, _ = scheduler.get_num_new_matched_tokens(req, 0)
        if tokens is not None:
            return tokens
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(LOOK_AGAIN_S)


def test_a_consumer_waits_for_the_producers_store_to_commit(plane: Plane) -> None:
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, store_wait_s=BOUND_S, **SETTINGS)
    req = consumer_request(WHOLE)
    scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)  # not a miss
    assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)  # still waiting
    produce(plane)
    assert asked_until_known(scheduler, req) == WHOLE


def test_a_consumer_takes_what_is_there_once_the_wait_is_over(plane: Plane) -> None:
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, store_wait_s=0.2, **SETTINGS)
    req = consumer_request(WHOLE)
    scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
    assert asked_until_known(scheduler, req) == 0  # the store never came: computed


def test_a_request_told_of_nothing_never_waits(plane: Plane) -> None:
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, store_wait_s=BOUND_S, **SETTINGS)
    req = request("r", PROMPT)
    scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)


def test_the_producers_answer_names_the_tokens_it_stored(plane: Plane) -> None:
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, **SETTINGS)
    req = request("r", PROMPT)
    scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.build_connector_meta(step_output(new=(("r", [1, 2, 3, 4, 5], 0, len(PROMPT)),)))
    hold, params = scheduler.request_finished(req, [1, 2, 3, 4, 5])
    assert params is not None and params["cmx"]["expect_tokens"] == WHOLE
    assert RequestOptions.of(params).expect_tokens == WHOLE  # a consumer reads it back
    # a store of it that fails: nothing to wait for
    side = scheduler._side_scheduler()
    side.take_report(CMXWorkerReport(stores=[StoreResult("r", WHOLE, 0, WHOLE, 0)]))
    assert "expect_tokens" not in params["cmx"]


@pytest.mark.parametrize("expect", [-1, True, "64", 1.5, None])
def test_a_bad_expectation_keeps_the_request_out_of_the_cache(expect: Any) -> None:
    options = RequestOptions.of({"cmx": {"expect_tokens": expect}})
    assert (options.load, options.store, options.expect_tokens) == (False, False, 0)


def test_no_store_to_wait_for_when_the_prompts_head_was_the_engines_own(plane: Plane) -> None:
    # The engine's own prefix cache held the first two blocks (the service holds none of
    # them): it stores from there on, and a consumer waiting for the whole would wait in vain.
    scheduler = connector(plane, KVConnectorRole.SCHEDULER, **SETTINGS)
    req = request("r", PROMPT)
    scheduler.on_new_request(req)
    assert scheduler.get_num_new_matched_tokens(req, 2 * T) == (0, False)
    scheduler.build_connector_meta(
        step_output(new=(("r", [1, 2, 3, 4, 5], 2 * T, len(PROMPT) - 2 * T),)))
    _, params = scheduler.request_finished(req, [1, 2, 3, 4, 5])
    assert params is not None and "expect_tokens" not in params["cmx"]
