"""Suite "service": what a local hit costs through ``NamespaceClient.load``.

- A local DRAM hit of 1 and of 16 small blocks (32 KiB), p50, against a bare Ray actor round
  trip on the same node in the same run: the control path, not the bytes, is the cost of
  small loads. A local hit is one call to the DRAM tier (``NodePlane.pin_prefix``), the
  client's verified copy out of shared memory, and a one-way unpin; any HBM copy is evicted
  before each load, so each is a DRAM hit.
- The consumer-side checksum on a 64 MiB DRAM-hit load (16 blocks of 4 MiB): what verifying
  adds to the load, against the whole verified load. Measured in pairs: each repetition loads
  once with the client's checks and once without, the order swapping every repetition
  (``intervals.alternated``); the figure is the median of the per-pair differences over the
  median verified load, with a bootstrap interval over pairs, and an interval reaching below
  zero is inconclusive, not a PASS (``Figure.paired_difference``). Beside it, XXH3 and memcpy
  alone on this machine.
- A prefix on the local NVMe tier alone, loaded and stored against fio (``nvme_hits``).
- The same under memory pressure: a prefix eight times the node's HBM and DRAM, loaded from
  NVMe through a few HBM windows at a time, against fio (``pressure``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from cmx.bench.harness.cluster import bench_cluster, on_node
from cmx.bench.harness.core import BenchContext, Figure, Goal, MiB, SuiteResult, median
from cmx.bench.harness.intervals import alternated
from cmx.bench.suites.hits.nvme_hits import nvme_prefix_figures
from cmx.bench.suites.hits.pressure import pressure_figures
from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.doors import Evict
from cmx.layout import KVLayout

__all__ = ["checksum_cost_figure", "run_service"]

SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
BIG = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=64)
ROUND_TRIPS = 200


def _round_trips(node: str) -> list[float]:
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> None:
            return None

    # The ignore below: a Ray actor class: .options comes from @ray.remote
    echo = Echo.options(scheduling_strategy=on_node(node)).remote()  # type: ignore[attr-defined]
    ray.get(echo.ping.remote())
    times = []
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter()
        ray.get(echo.ping.remote())
        times.append(time.perf_counter() - t0)
    ray.kill(echo)
    return times


def _stored(cm: Any, layout: KVLayout, blocks: int) -> tuple[Any, np.ndarray, list[Any]]:
    ns = cm.namespace("bench-hits", layout, uuid.uuid4().hex[:8])
    toks = np.random.default_rng(blocks).integers(0, 50_000, blocks * layout.block_tokens)
    if ns.store(toks, layout.random_kv(len(toks), seed=blocks)).wait() != blocks:
        raise AssertionError(f"stored fewer than {blocks} blocks")
    return ns, toks, [b.key for b in ns.lookup(toks).blocks]


def _dram_hits(cm: Any, ns: Any, toks: np.ndarray, keys: list[Any], reps: int) -> list[float]:
    """Load times of ``toks`` through the client, each a DRAM hit (HBM copy evicted first)."""
    from cmx.links import actor_name

    hbm = actor_name("hbm", cm.node_id)
    times = []
    for _ in range(reps):
        cm.link.call(hbm, Evict(keys=keys))
        t0 = time.perf_counter()
        got = ns.load(toks)
        times.append(time.perf_counter() - t0)
        if got.shape[3] != len(toks):
            raise AssertionError(f"loaded {got.shape[3]} of {len(toks)} tokens")
    return times


def _verify_cost(cm: Any, ns: Any, toks: np.ndarray, keys: list[Any], n: int
                 ) -> tuple[list[float], list[float]]:
    """``n`` pairs of load times of ``toks`` (DRAM hits), with the client's checks and without,
    the order swapping every pair, so both see the same minute of a busy machine."""
    def verified() -> float:
        return _dram_hits(cm, ns, toks, keys, 1)[0]

    def unverified() -> float:
        ns.verify = False
        try:
            return _dram_hits(cm, ns, toks, keys, 1)[0]
        finally:
            ns.verify = True

    return alternated(n, verified, unverified)


def _alone_gbps(nbytes: int) -> tuple[float, float]:
    """XXH3 over ``nbytes`` and numpy memcpy of them, each alone in this process (GB/s):
    what the client's fused copy and check are made of on this machine."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    sums, copies = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        checksum(src)
        t1 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t1)
        sums.append(t1 - t0)
    return nbytes / median(sums) / 1e9, nbytes / median(copies) / 1e9


def checksum_cost_figure(loads: list[float], bare: list[float], xxh3: float,
                         memcpy: float) -> Figure:
    """What the client's checks add to a 64 MiB load: ``loads[i]`` (verified) and ``bare[i]``
    (unverified) are one pair, in seconds."""
    return Figure.paired_difference(
        "service", "consumer-side checksum of a 64 MiB DRAM-hit load (load verified - "
        "unverified, per pair)", "s", loads, bare,
        "the whole verified load through ContextMemory.load", Goal("<=", 0.10),
        note=f"verified load {median(loads) * 1e3:.1f} ms ({64 * MiB / median(loads) / 1e9:.2f} "
             f"GB/s), unverified {median(bare) * 1e3:.1f} ms, medians of {len(loads)} pairs, "
             f"the order swapped every pair; alone in the client's process: XXH3 {xxh3:.1f} "
             f"GB/s, numpy memcpy {memcpy:.1f} GB/s")


def run_service(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("service", command="")
    reps = 30 * ctx.config.reps
    config = ServiceConfig(block_bytes=BIG.block_bytes, hbm_bytes=32 * BIG.block_bytes,
                           dram_bytes=40 * BIG.block_bytes, nvme_bytes=128 * BIG.block_bytes,
                           nvme_dir=str(ctx.scratch("service")), load_timeout_s=120)
    with bench_cluster(config) as bc:
        cm = bc.cm
        ctx.log("service: bare Ray actor round trips")
        rtt = _round_trips(cm.node_id)
        rtt_ms = tuple(t * 1e3 for t in rtt)
        for blocks in (1, 16):
            ns, toks, keys = _stored(cm, SMALL, blocks)
            _dram_hits(cm, ns, toks, keys, 3)  # the client maps the HBM arena once
            ctx.log(f"service: {reps} DRAM hits of {blocks} block(s)")
            times = _dram_hits(cm, ns, toks, keys, reps)
            result.figures.append(Figure(
                "service", f"local DRAM hit, {blocks} x 32 KiB, ContextMemory.load p50", "ms",
                tuple(t * 1e3 for t in times), "bare Ray actor round trip p50", rtt_ms,
                Goal("<=", 3.0),
                note=f"the ratio is in round trips; load p99 "
                     f"{np.percentile(times, 99) * 1e3:.2f} ms"))
        ns, toks, keys = _stored(cm, BIG, 16)  # 64 MiB
        ctx.log("service: 64 MiB DRAM hits, with the client's checks and without")
        _dram_hits(cm, ns, toks, keys, 2)
        loads, bare = _verify_cost(cm, ns, toks, keys, 10 * ctx.config.reps + 1)
    xxh3, memcpy = _alone_gbps(64 * MiB)
    result.figures.append(checksum_cost_figure(loads, bare, xxh3, memcpy))
    figures, notes = nvme_prefix_figures(ctx)
    result.figures += figures
    result.notes += notes
    try:
        result.figures += pressure_figures(ctx)
    except Exception as exc:  # noqa: BLE001 - its cluster's failure costs only its figure
        ctx.log(f"service: the memory-pressure load failed: {exc}")
        result.notes.append(f"load under memory pressure: no figure, {type(exc).__name__}: {exc}")
    return result
