"""What vLLM sees of CMXConnector: its counters through vLLM's own connector-stats logging, and
``reset_cache`` dropping the engine's namespaces from the service (an in-process plane)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
from plane import Plane
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm_plane import LAYOUT, T, client_of, connector, plane_of

from cmx.connectors.settings import ConnectorSettings, Namespaces, namespace_salt
from cmx.connectors.vllm import CMXConnector
from cmx.connectors.vllm_scheduler import SchedulerSide
from cmx.connectors.vllm_stats import COUNTERS, CMXConnectorStats

PROMPT = list(range(900, 900 + 3 * T + 1))  # three full blocks and one token


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = plane_of(tmp_path)
    yield p
    p.close()


def test_vllm_logs_the_sum_of_both_sides_counts() -> None:
    worker = CMXConnectorStats()
    worker.add(loads=2, loaded_tokens=64, load_failed_tokens=8, load_s=0.5, stored_tokens=32,
               store_failed_tokens=16)
    scheduler = CMXConnectorStats()
    scheduler.add(lookups=3, lookup_failures=1, hit_tokens=72, offered_tokens=64)
    step = worker.aggregate(scheduler)  # as vLLM's scheduler joins them each step
    logging = KVConnectorLogging(KVTransferConfig(
        kv_connector="CMXConnector", kv_connector_module_path="cmx.connectors.vllm",
        kv_role="kv_both"))
    logging.observe(dict(step.data))  # the data crosses processes; vLLM rebuilds the stats
    logging.observe(dict(step.data))  # a second step in the same interval
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == [
        "KV Transfer metrics: Lookups=6, Failed lookups=2, Hit tokens=144, Offered tokens=128, "
        "Loads=4, Loaded tokens=128, Failed load tokens=16, Avg load (ms)=250.0, "
        "Stored tokens=64, Failed store tokens=32, Dropped store tokens=0"]


def test_the_counts_reach_vllms_prometheus_endpoint_per_engine() -> None:
    from vllm.config import VllmConfig

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry)
             for kind in (Counter, Gauge, Histogram)}
    vllm_config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="CMXConnector", kv_connector_module_path="cmx.connectors.vllm",
        kv_role="kv_both"))
    prom = CMXConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"],
                                           {0: ["m", "0"], 1: ["m", "1"]})
    step = CMXConnectorStats()
    step.add(loaded_tokens=64, load_s=0.25, stored_tokens=32, store_failed_tokens=16)
    prom.observe(step.data, engine_idx=1)
    prom.observe(step.data, engine_idx=1)

    def sample(name: str, engine: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine})

    assert sample("vllm:cmx_loaded_tokens_total", "1") == 128
    assert sample("vllm:cmx_load_seconds_total", "1") == 0.5
    assert sample("vllm:cmx_stored_tokens_total", "1") == 64
    assert sample("vllm:cmx_store_failed_tokens_total", "1") == 32
    assert sample("vllm:cmx_loaded_tokens_total", "0") == 0


def test_stats_refuse_names_they_do_not_know() -> None:
    with pytest.raises(ValueError, match="unknown"):
        CMXConnectorStats(data={"stored": 1})
    with pytest.raises(ValueError, match="unknown"):
        CMXConnectorStats().add(stored=1)
    assert CMXConnector.build_kv_connector_stats(None).data == dict.fromkeys(COUNTERS, 0)


def test_the_scheduler_counts_its_lookups_hits_and_offers(plane: Plane) -> None:
    cm = client_of(plane, plane.config)
    namespaces = Namespaces(cm, "m", LAYOUT, "w")
    kv = LAYOUT.random_kv(2 * T, seed=3)
    assert namespaces.get("").store(PROMPT[:2 * T], kv).wait() == 2
    side = SchedulerSide(ConnectorSettings(gate=False, lookup_wait_s=30.0), namespaces, T)
    side.track("r", PROMPT, None)
    assert side.matched_tokens("r", 0) == 2 * T
    side.track("s", PROMPT, None)
    assert side.matched_tokens("s", T) == T  # the engine's own cache held the first block
    stats = side.take_stats()
    assert stats is not None
    assert (stats.data["lookups"], stats.data["hit_tokens"], stats.data["offered_tokens"]) == (
        2, 3 * T, 3 * T)
    assert side.take_stats() is None  # taken: nothing new since
    side.shutdown()


def test_reset_cache_drops_the_namespaces_the_engine_used_and_no_other(plane: Plane) -> None:
    conn = connector(plane, KVConnectorRole.SCHEDULER, salt="tenant")
    cm = conn._cm
    used = Namespaces(cm, "m", LAYOUT, "w").get(namespace_salt("tenant", "a"))
    other = Namespaces(cm, "m", LAYOUT, "w").get("another-engine")
    for ns in (used, other):
        assert ns.store(PROMPT[:2 * T], LAYOUT.random_kv(2 * T, seed=4)).wait() == 2
    conn._side_scheduler().track("r", PROMPT, "a")  # a request with cache_salt "a"
    assert conn.reset_cache() is True
    assert used.lookup(PROMPT).num_tokens == 0
    assert other.lookup(PROMPT).num_tokens == 2 * T
    conn.shutdown()


def test_a_workers_connector_leaves_reset_to_the_scheduler(plane: Plane) -> None:
    conn: Any = connector(plane, KVConnectorRole.WORKER)
    assert conn.reset_cache() is None
    conn.shutdown()


def test_after_reset_cache_a_store_still_under_way_is_out_of_new_requests_reach(
    plane: Plane,
) -> None:
    conn = connector(plane, KVConnectorRole.SCHEDULER, salt="tenant")
    side = conn._side_scheduler()
    side.track("before", PROMPT, "a")
    before = side.namespaces.get(side.requests["before"].salt)
    assert conn.reset_cache() is True
    # A store handed to a worker before the reset commits after it (vLLM cannot wait for it).
    assert before.store(PROMPT[:2 * T], LAYOUT.random_kv(2 * T, seed=5)).wait() == 2
    side.track("after", PROMPT, "a")
    after = side.namespaces.get(side.requests["after"].salt)
    assert after.namespace.digest != before.namespace.digest
    assert after.lookup(PROMPT).num_tokens == 0  # the old weights' KV is never loaded
    conn.shutdown()


def test_requests_kept_out_of_the_cache_open_no_namespace(plane: Plane) -> None:
    conn = connector(plane, KVConnectorRole.SCHEDULER, salt="tenant")
    side = conn._side_scheduler()
    for i in range(50):  # as the Serve app's cache-off requests: a salt of their own each
        side.track(f"r{i}", PROMPT, f"nocache-{i}", {"cmx": {"load": False, "store": False}})
    assert side.namespaces.opened() == []
    conn.shutdown()
