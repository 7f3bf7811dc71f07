"""The result files of vLLM's benchmark client (``python -m vllm.benchmarks.serve``), read and
merged across clients.

Each client writes one JSON file (``--save-result``); with ``--save-detailed`` it holds every
request's TTFT (``ttfts``, seconds) and error (``errors``, "" when it succeeded). Two clients,
each driving one of two servers, are one run: requests and tokens add up, the run lasts as long
as the longer client, and TTFT percentiles are taken over both clients' requests together (a
percentile of two percentiles is not one). Repeated runs of the same settings pool the same
way (``pool``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ClientResult", "ServeRun", "merge", "parse_result", "percentile", "pool",
           "prompt_tokens", "read_result"]

PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"  # vLLM's counter, labelled by source


@dataclass(frozen=True)
class ClientResult:
    """One client's result file: what it sent and what came back."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    ttfts_s: tuple[float, ...]  # of the completed requests

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s else math.nan


def parse_result(data: Mapping[str, Any]) -> ClientResult:
    """A ``ClientResult`` from a result's JSON; ValueError if it lacks per-request TTFTs."""
    if "ttfts" not in data:
        raise ValueError("the result has no per-request TTFTs: run the client with "
                         "--save-result --save-detailed")
    ttfts = [float(t) for t in data["ttfts"]]
    errors = list(data.get("errors") or [""] * len(ttfts))
    if len(errors) != len(ttfts):
        raise ValueError(f"{len(ttfts)} TTFTs but {len(errors)} errors in the result")
    return ClientResult(
        completed=int(data["completed"]), failed=int(data.get("failed", 0)),
        duration_s=float(data["duration"]), input_tokens=int(data["total_input_tokens"]),
        output_tokens=int(data.get("total_output_tokens", 0)),
        ttfts_s=tuple(t for t, e in zip(ttfts, errors, strict=True) if not e))


def read_result(path: Path) -> ClientResult:
    return parse_result(json.loads(path.read_text()))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class ServeRun:
    """Every client of one run together: one row of the table."""

    completed: int
    failed: int
    duration_s: float  # the longest client's
    request_throughput: float  # completed requests per second, all clients
    token_throughput: float  # input and output tokens per second, all clients
    ttft_p50_ms: float
    ttft_p99_ms: float


def merge(results: Sequence[ClientResult]) -> ServeRun:
    """One run of clients that ran at the same time."""
    return pool([results])


def pool(runs: Sequence[Sequence[ClientResult]]) -> ServeRun:
    """Runs one after the other, each of clients that ran at the same time, as one: a run
    lasts as long as its longest client, the runs' durations add up, and the percentiles
    are taken over every request of every run."""
    if not runs or not all(runs):
        raise ValueError("pool of no results")
    duration = sum(max(r.duration_s for r in results) for results in runs)
    every = [r for results in runs for r in results]
    completed = sum(r.completed for r in every)
    tokens = sum(r.input_tokens + r.output_tokens for r in every)
    ttfts = [t for r in every for t in r.ttfts_s]
    return ServeRun(
        completed=completed, failed=sum(r.failed for r in every), duration_s=duration,
        request_throughput=completed / duration if duration else math.nan,
        token_throughput=tokens / duration if duration else math.nan,
        ttft_p50_ms=percentile(ttfts, 50) * 1000, ttft_p99_ms=percentile(ttfts, 99) * 1000)


def prompt_tokens(metrics: str) -> dict[str, float]:
    """Prompt tokens by where they came from, summed over engines, from a server's
    Prometheus text (``/metrics``): ``local_compute`` (prefilled), ``local_cache_hit``
    (vLLM's own prefix cache), ``external_kv_transfer`` (loaded by the connector)."""
    got: dict[str, float] = {}
    for line in metrics.splitlines():
        if not line.startswith(PROMPT_TOKENS + "{"):
            continue
        labels, _, value = line[len(PROMPT_TOKENS) + 1:].rpartition("}")
        for label in labels.split(","):
            name, _, quoted = label.partition("=")
            if name.strip() == "source":
                source = quoted.strip().strip('"')
                got[source] = got.get(source, 0.0) + float(value)
    return got
