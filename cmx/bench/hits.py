"""Suite "service": what a local hit costs through ``ContextMemory.load``.

- A local DRAM hit of 1 and of 16 small blocks (32 KiB), p50, against a bare Ray actor round
  trip on the same node in the same run: the control path, not the bytes, is the cost of
  small loads. A local hit is one call to the DRAM tier (``NodePlane.pin_prefix``), the
  client's verified copy out of shared memory, and a one-way unpin; any HBM copy is evicted
  before each load, so each is a DRAM hit.
- The consumer-side checksum on a 64 MiB DRAM-hit load (16 blocks of 4 MiB): the time the
  client spends verifying the blocks it copies out, against the whole load.
- A prefix on the local NVMe tier alone, loaded and stored against fio (``nvme_hits``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from cmx.bench.cluster import bench_cluster, on_node
from cmx.bench.core import BenchContext, Figure, Goal, MiB, SuiteResult, median
from cmx.bench.nvme_hits import nvme_prefix_figures
from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.layout import KVLayout

__all__ = ["run_service"]

SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
BIG = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=64)
ROUND_TRIPS = 200


def _round_trips(node: str) -> list[float]:
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> None:
            return None

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
    from cmx.actors.links import actor_name

    hbm = actor_name("hbm", cm.node_id)
    times = []
    for _ in range(reps):
        cm.link.call(hbm, "evict", keys)
        t0 = time.perf_counter()
        got = ns.load(toks)
        times.append(time.perf_counter() - t0)
        if got.shape[3] != len(toks):
            raise AssertionError(f"loaded {got.shape[3]} of {len(toks)} tokens")
    return times


def _checksum_seconds(cm: Any, keys: list[Any], copies: list[Any]) -> float:
    """What the client's check of a load's blocks takes: XXH3 over each HBM slot it copies."""
    from cmx.actors.links import actor_name
    from cmx.protocol import Priority
    from cmx.storage.arena import SharedArena

    agent = actor_name("agent", cm.node_id)
    cm.link.call(actor_name("hbm", cm.node_id), "evict", keys)
    result = cm.link.call(agent, "load", keys, copies, Priority.LOAD, "bench:checksum")
    arena = SharedArena.attach(result.arena)
    try:
        t0 = time.perf_counter()
        for b in result.blocks:
            checksum(arena.slot_view(b.slot)[: b.size])
        return time.perf_counter() - t0
    finally:
        cm.link.call(agent, "release", [b.lease for b in result.blocks])
        arena.close()


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
        copies = [list(b.copies) for b in ns.lookup(toks).blocks]
        ctx.log("service: 64 MiB DRAM hits, and the client's checksum of them")
        loads = _dram_hits(cm, ns, toks, keys, 2 * ctx.config.reps + 1)
        sums = [_checksum_seconds(cm, keys, copies) for _ in range(2 * ctx.config.reps + 1)]
    result.figures.append(Figure(
        "service", "consumer-side checksum of a 64 MiB DRAM-hit load", "s", (median(sums),),
        "the whole load through ContextMemory.load", (median(loads),), Goal("<=", 0.10),
        note=f"load {median(loads) * 1e3:.1f} ms ({64 * MiB / median(loads) / 1e9:.2f} GB/s), "
             f"checksum {median(sums) * 1e3:.1f} ms"))
    figures, notes = nvme_prefix_figures(ctx)
    result.figures += figures
    result.notes += notes
    return result
