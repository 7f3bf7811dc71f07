"""What ``CMXConnector`` shows vLLM: its counters, through vLLM's connector-stats hook.

Each side of the connector counts what it did (``Counters``, from any of its threads) and hands
the counts over when vLLM asks (``get_kv_connector_stats``, once a step on each side). vLLM adds
the worker's and the scheduler's figures (``aggregate``), sums them over its logging interval and
logs ``reduce()`` as "KV Transfer metrics: ..."; between processes the stats travel as their
``data``, a plain dict of numbers, rebuilt by ``CMXConnector.build_kv_connector_stats``. On
vLLM's Prometheus endpoint each counter is ``vllm:cmx_<name>_total`` (``CMXPromMetrics``), with
vLLM's per-engine labels.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "CMXConnectorStats", "CMXPromMetrics", "Counters"]

COUNTERS = {  # name: what it counts (and which side counts it)
    "lookups": "Prompts looked up in the context memory (scheduler).",
    "lookup_failures": "Lookups that failed, taken as misses (scheduler).",
    "hit_tokens": "Tokens found in the context memory beyond the engine's own cache "
                  "(scheduler).",
    "offered_tokens": "Found tokens offered to vLLM to load, after break-even gating "
                      "(scheduler).",
    "loads": "Loads from the context memory (worker).",
    "loaded_tokens": "Tokens loaded into the engine's KV cache (worker).",
    "load_failed_tokens": "Tokens promised but not loaded, recomputed by vLLM (worker).",
    "load_s": "Seconds of loads, from each load's start to its end (worker).",
    "stored_tokens": "Tokens in blocks the context memory committed (worker).",
    "store_failed_tokens": "Tokens of stores refused, failed or timed out (worker).",
    "store_dropped_tokens": "Tokens not stored: too many stores in flight, or (async saves) "
                            "the staging budget full (worker).",
}


@dataclass
class CMXConnectorStats(KVConnectorStats):
    """Counts since the last hand-over; every name of ``COUNTERS`` is always in ``data``."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(COUNTERS))
        if unknown:
            raise ValueError(f"unknown CMXConnector stats {unknown}; known: {list(COUNTERS)}")
        self.data = {name: self.data.get(name, 0) for name in COUNTERS}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            if name not in self.data:
                raise ValueError(f"unknown CMXConnector stat {name!r}")
            self.data[name] += value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, CMXConnectorStats):
            raise TypeError(f"cannot add {type(other).__name__} to CMXConnectorStats")
        self.add(**other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        loads = d["loads"]
        return {
            "Lookups": d["lookups"], "Failed lookups": d["lookup_failures"],
            "Hit tokens": d["hit_tokens"], "Offered tokens": d["offered_tokens"],
            "Loads": loads, "Loaded tokens": d["loaded_tokens"],
            "Failed load tokens": d["load_failed_tokens"],
            "Avg load (ms)": round(1000 * d["load_s"] / loads, 3) if loads else 0,
            "Stored tokens": d["stored_tokens"], "Failed store tokens": d["store_failed_tokens"],
            "Dropped store tokens": d["store_dropped_tokens"],
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Counters:
    """One side's counts: added to from any thread, taken (and reset) by vLLM's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = CMXConnectorStats()

    def add(self, **counts: float) -> None:
        with self._lock:
            self._stats.add(**counts)

    def take(self) -> CMXConnectorStats | None:
        """The counts since the last take; None if nothing was counted."""
        with self._lock:
            stats, self._stats = self._stats, CMXConnectorStats()
        return None if stats.is_empty() else stats


class CMXPromMetrics(KVConnectorPromMetrics):
    """The counters on vLLM's Prometheus endpoint: ``vllm:cmx_<name>_total`` per engine
    (``load_s`` as ``vllm:cmx_load_seconds_total``)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, documentation in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:cmx_{'load_seconds' if name == 'load_s' else name}",
                documentation=documentation, labelnames=labelnames)
            self.counters[name] = {engine: metric.labels(*values)
                                   for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self.counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)
