"""Suites of the service on a local Ray cluster: "transfer", "directory" and "pool".

- ``transfer``: node b's agent loads 1 GiB of 32 MiB blocks held in node a's DRAM (NIXL over
  UCX, checksums verified, into b's HBM arena). Baselines in the same run: numpy memcpy of the
  same bytes (right after each load), and ``ray.get`` on node b of the same bytes held on
  node a (after all the loads: see ``run_transfer``).
- ``directory``: one batched lookup of a 1,000-block prefix through the client (all shards in
  flight), by shard count; lookups per second; index memory per block; how lookup cost and
  memory grow as the directory holds 10x and 100x more blocks.
- ``pool``: load of the same bytes from the pool (two pool nodes) against local NVMe.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Any, cast

import numpy as np

from cmx.bench.harness.cluster import LLAMA, SMALL, bench_cluster, on_node, store_prefix
from cmx.bench.harness.core import GB, BenchContext, Figure, Goal, MiB, SuiteResult, Table, median
from cmx.config import ServiceConfig
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.stats import AgentStats, transport_of

__all__ = ["run_directory", "run_pool", "run_transfer"]


def _memcpy_gbps(nbytes: int) -> float:
    """numpy memcpy between two buffers whose pages are already faulted in."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    dst.fill(0)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return nbytes / (time.perf_counter() - t0) / GB


def _transport_seconds(agent: Any) -> float:
    """Seconds the agent's transport has spent moving bytes, from its stats."""
    import ray

    stats: AgentStats = ray.get(agent.stats.remote())
    return stats.transport_stats.seconds


def _agent_load_gbps(cm: Any, node: str, ns: Any, toks: np.ndarray) -> tuple[float, float]:
    """One load by ``node``'s agent into its HBM arena, evicted from there afterwards.

    GB/s of the whole load, and of the transport's transfers within it (from the agent's
    stats): the rest is the agent's path around them (pins, reservations, checksums, commits).
    """
    import ray

    from cmx.links import RAY_NAMESPACE, actor_name

    match = ns.lookup(toks)
    keys = [b.key for b in match.blocks]
    agent = ray.get_actor(actor_name("agent", node), namespace=RAY_NAMESPACE)
    hbm = ray.get_actor(actor_name("hbm", node), namespace=RAY_NAMESPACE)
    before = _transport_seconds(agent)
    t0 = time.perf_counter()
    result: Any = ray.get(agent.load.remote(keys, [list(b.copies) for b in match.blocks]))
    dt = time.perf_counter() - t0
    moving = _transport_seconds(agent) - before
    loaded = sum(b.size for b in result.blocks)
    ray.get(agent.release.remote([b.lease for b in result.blocks]))
    ray.get(hbm.evict.remote(keys))
    if len(result.blocks) != len(keys):
        raise AssertionError(f"loaded {len(result.blocks)} of {len(keys)} blocks")
    return loaded / dt / GB, loaded / moving / GB if moving > 0 else float("nan")


def run_transfer(ctx: BenchContext) -> SuiteResult:
    import ray

    result = SuiteResult("transfer", command="")
    blocks = 32  # 1 GiB of 32 MiB blocks
    nbytes = blocks * LLAMA.block_bytes
    config = ServiceConfig(block_bytes=LLAMA.block_bytes, hbm_bytes=nbytes + 4 * LLAMA.block_bytes,
                           dram_bytes=nbytes + 4 * LLAMA.block_bytes, nvme_bytes=4 * nbytes,
                           nvme_dir=str(ctx.scratch("transfer")), load_timeout_s=300)
    with bench_cluster(config) as bc:
        ctx.log("transfer: storing 1 GiB on node a")
        ns, toks = store_prefix(bc.cm, LLAMA, blocks, seed=1)

        @ray.remote(num_cpus=0)
        class Holder:
            def make(self, n: int) -> list[Any]:
                return [ray.put(np.ones(n, np.uint8))]

        @ray.remote(num_cpus=0)
        class Fetcher:
            def fetch(self, refs: list[Any]) -> float:
                t0 = time.perf_counter()
                arr = ray.get(refs[0])
                return arr.nbytes / (time.perf_counter() - t0) / GB

        # Both baseline actors start (a worker process each) before anything is timed.
        # ray.remote keeps a class's own type for mypy, which then knows no .options.
        holder = cast(Any, Holder).options(scheduling_strategy=on_node(bc.node_a)).remote()
        fetcher = cast(Any, Fetcher).options(scheduling_strategy=on_node(bc.node_b)).remote()
        ray.get(fetcher.fetch.remote(ray.get(holder.make.remote(1))))
        # One load untimed: node b's agent connects to node a's on its first read.
        _agent_load_gbps(bc.cm, bc.node_b, ns, toks)
        nixl, moving, memcpy, rayget = [], [], [], []
        for rep in range(ctx.config.reps):
            ctx.log(f"transfer rep {rep + 1}/{ctx.config.reps}")
            whole, transfers = _agent_load_gbps(bc.cm, bc.node_b, ns, toks)
            nixl.append(whole)
            moving.append(transfers)
            memcpy.append(_memcpy_gbps(nbytes))
        # ray.get's repetitions come last: for seconds after a 1 GiB object moves, Ray's
        # object stores and raylets keep both cores busy, and a load measured then ran at a
        # third of its speed.
        for rep in range(ctx.config.reps):
            ctx.log(f"transfer, ray.get rep {rep + 1}/{ctx.config.reps}")
            refs = ray.get(holder.make.remote(nbytes))
            rayget.append(ray.get(fetcher.fetch.remote(refs)))
            del refs
        ray.kill(holder)
        ray.kill(fetcher)
        via = transport_of(bc.cm.stats(), bc.node_b)
    result.figures.append(Figure(
        "transfer", f"cross-node load of 1 GiB (32 MiB blocks), {via}, verified", "GB/s",
        tuple(nixl), "numpy memcpy of 1 GiB", tuple(memcpy), Goal(">=", 0.5)))
    result.figures.append(Figure(
        "transfer", f"cross-node load of 1 GiB, {via}", "GB/s", tuple(nixl),
        "ray.get of 1 GiB on node b, held on node a", tuple(rayget), Goal(">=", 1.0),
        note="goal: faster than Ray's object store"))
    result.figures.append(Figure(
        "transfer", f"{via} transfers alone, within that load", "GB/s", tuple(moving),
        "numpy memcpy of 1 GiB", tuple(memcpy), None,
        note="the transport's own time (agent stats): the rest of the load is the agent's "
             "path around it: pins, reservations, checksums of every block, commits"))
    return result


def _lookup_latencies(cm: Any, ns: Any, toks: np.ndarray, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        match = ns.lookup(toks)
        out.append(time.perf_counter() - t0)
        if match.num_blocks != len(toks) // ns.layout.block_tokens:
            raise AssertionError(f"lookup found {match.num_blocks} blocks")
    return out


def run_directory(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("directory", command="")
    rows = []
    per_call = 50 * ctx.config.reps
    for shards in (1, 2, 4):
        config = ServiceConfig(block_bytes=SMALL.block_bytes, hbm_bytes=64 * MiB,
                               dram_bytes=256 * MiB, nvme_bytes=512 * MiB, directory_shards=shards,
                               nvme_dir=str(ctx.scratch(f"dir-{shards}")))
        with bench_cluster(config) as bc:
            ctx.log(f"directory: {shards} shard(s), storing a 1,000-block prefix")
            ns, toks = store_prefix(bc.cm, SMALL, 1000, seed=shards)
            lat = _lookup_latencies(bc.cm, ns, toks, per_call)
        local = _in_process_lookup_ms(1000)
        p50, p99 = float(np.percentile(lat, 50)), float(np.percentile(lat, 99))
        rows.append((str(shards), f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{1 / median(lat):.0f}"))
        result.figures.append(Figure(
            "directory", f"batched lookup of a 1,000-block prefix, {shards} shard(s), p50",
            "ms", (p50 * 1e3,), "the same lookup in-process (no Ray)", (local,), None,
            note=f"p99 {p99 * 1e3:.2f} ms; {1 / median(lat):.0f} lookups/s"))
    result.tables.append(Table("Batched 1,000-block lookups through the client",
                               ("shards", "p50 ms", "p99 ms", "lookups/s"), tuple(rows)))
    result.tables.append(_growth(ctx))
    per_block = tuple(_index_bytes_per_block(10_000) for _ in range(ctx.config.reps))
    result.figures.append(Figure(
        "directory", "index memory per block (10K blocks, one copy each)", "bytes", per_block,
        "budget", (256.0,) * len(per_block), Goal("<=", 1.0)))
    return result


def _shard_with(n: int) -> tuple[Any, list[BlockHash]]:
    from cmx.actors.directory.shard import DirectoryShard, Entry, Source
    from cmx.tiers import Tier

    keys = chain_keys(Namespace("g", SMALL).digest, np.arange(n * 16) % 50_000, 16)
    shard = DirectoryShard()
    shard.resync(Source("node", Tier.DRAM), "e", 0,
                 (Entry(k, True, 4096, i, "ns") for i, k in enumerate(keys)))
    return shard, keys


def _index_bytes_per_block(n: int) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    shard, keys = _shard_with(n)
    del keys
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del shard
    return (after - before) / n


def _in_process_lookup_ms(n: int) -> float:
    shard, keys = _shard_with(n)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        shard.lookup(keys)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def _growth(ctx: BenchContext) -> Table:
    """Lookup time of a 1,000-block prefix and bytes per block, in-process, as blocks grow."""
    rows: list[tuple[str, ...]] = []
    for n in (10_000, 100_000, 1_000_000):
        ctx.log(f"directory growth: {n} blocks")
        shard, keys = _shard_with(n)
        probe = keys[:1000]
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            shard.lookup(probe)
            times.append(time.perf_counter() - t0)
        rows.append((f"{n:,}", f"{median(times) * 1e3:.3f}"))
        del shard, keys
    for row, n in zip(list(rows), (10_000, 100_000, 1_000_000)):
        rows[rows.index(row)] = (*row, f"{_index_bytes_per_block(min(n, 100_000)):.0f}")
    return Table("Directory shard growth (in-process): lookup of 1,000 keys",
                 ("blocks held", "lookup ms (median)", "index bytes/block"), tuple(rows))


def run_pool(ctx: BenchContext) -> SuiteResult:
    import ray

    from cmx.links import RAY_NAMESPACE, actor_name
    from cmx.tiers import Tier

    result = SuiteResult("pool", command="")
    blocks = 16  # 512 MiB of 32 MiB blocks
    nbytes = blocks * LLAMA.block_bytes
    config = ServiceConfig(
        block_bytes=LLAMA.block_bytes, hbm_bytes=nbytes + 4 * LLAMA.block_bytes,
        dram_bytes=8 * LLAMA.block_bytes, nvme_bytes=4 * nbytes, pool_bytes=4 * nbytes,
        pool_staging_bytes=4 * LLAMA.block_bytes, pool_admission_min_count=1,
        pool_replication=1, placement="write_through", nvme_dir=str(ctx.scratch("pool")),
        load_timeout_s=300)
    with bench_cluster(config, pool_nodes=2) as bc:
        ctx.log("pool: storing 512 MiB on node a (pooled as stored)")
        ns, toks = store_prefix(bc.cm, LLAMA, blocks, seed=3)
        keys = [b.key for b in ns.lookup(toks).blocks]

        def evict(node: str, tiers: tuple[Tier, ...]) -> None:
            for tier in tiers:
                ray.get(ray.get_actor(actor_name(tier.value, node), namespace=RAY_NAMESPACE)
                        .evict.remote(keys))

        # Local NVMe: the blocks only in node a's NVMe (DRAM and HBM copies dropped).
        evict(bc.node_a, (Tier.HBM, Tier.DRAM))
        nvme_copies = sum(1 for b in ns.lookup(toks).blocks
                          if any(c.tier is Tier.NVME for c in b.copies))
        if nvme_copies != blocks:  # not every block was demoted yet: write the rest now
            raise AssertionError(f"{nvme_copies} of {blocks} blocks in node a's NVMe")
        local, pool = [], []
        for rep in range(ctx.config.reps):
            ctx.log(f"pool rep {rep + 1}/{ctx.config.reps}")
            ctx.drop_cache()
            local.append(_agent_load_gbps(bc.cm, bc.node_a, ns, toks)[0])
        # The pool: drop node a's NVMe copies too; node a loads from the pool nodes.
        evict(bc.node_a, (Tier.NVME,))
        for _ in range(ctx.config.reps):
            ctx.drop_cache()
            for p in bc.pool:  # cold: drop the pool nodes' staging caches
                ray.get(ray.get_actor(actor_name("pool", p), namespace=RAY_NAMESPACE)
                        .drop_staging.remote())
            pool.append(_agent_load_gbps(bc.cm, bc.node_a, ns, toks)[0])
    result.figures.append(Figure(
        "pool", "load of 512 MiB (32 MiB blocks) from the pool (2 nodes), verified", "GB/s",
        tuple(pool), "the same bytes from local NVMe", tuple(local), None,
        note="pool reads: pool NVMe -> pool staging DRAM -> NIXL -> HBM"))
    return result
