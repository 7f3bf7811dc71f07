"""A figure of suite "service": a prefix larger than the node's HBM and DRAM, loaded from NVMe.

``NamespaceClient.load`` of a 512 MiB prefix of 2 MiB blocks on a node whose HBM and DRAM tiers
each hold an eighth of it: the prefix is stored, evicted down to NVMe, and loaded window by
window through HBM slots that each window's blocks take in turn (``cmx.client.loads``). The
baseline is fio's O_DIRECT sequential read of the same number of bytes (I/Os of one block,
QD16), measured in the same run, alternating with the loads (fio, load, fio, load, ...), so
both see the same minutes of a shared machine.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np

from cmx.bench.cluster import bench_cluster
from cmx.bench.core import GB, BenchContext, Figure, GiB, Goal, MiB, SuiteResult, median
from cmx.bench.nvme_hits import fio_same_bytes
from cmx.config import ServiceConfig
from cmx.doors import Evict
from cmx.layout import KVLayout

__all__ = ["PREFIX_BYTES", "TIER_SHARE", "pressure_figures", "run_pressure"]

PREFIX_BYTES = 512 * MiB
TIER_SHARE = 8  # HBM and DRAM each hold 1/TIER_SHARE of the prefix
BLOCK_TOKENS = 16  # 128 KiB of KV per token: 2 MiB blocks
GOAL = 0.8

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16",
                  block_tokens=BLOCK_TOKENS)


def pressure_config(nvme_dir: str, prefix_bytes: int = PREFIX_BYTES,
                    block_bytes: int = LAYOUT.block_bytes) -> ServiceConfig:
    """HBM and DRAM each an eighth of the prefix; NVMe four times it."""
    tier = prefix_bytes // TIER_SHARE
    return ServiceConfig(block_bytes=block_bytes, hbm_bytes=tier, dram_bytes=tier,
                         nvme_bytes=4 * prefix_bytes, nvme_segment_bytes=min(GiB, prefix_bytes),
                         placement="write_through", nvme_dir=nvme_dir, load_timeout_s=300,
                         call_timeout_s=60)


def _store(cm: Any, nbytes: int) -> tuple[Any, np.ndarray]:
    """Store a fresh prefix of ``nbytes``, in calls of half the DRAM tier."""
    ns = cm.namespace("bench-pressure", LAYOUT, uuid.uuid4().hex[:8])
    blocks, T = nbytes // LAYOUT.block_bytes, LAYOUT.block_tokens
    per_call = max(1, cm.config.dram_bytes // LAYOUT.block_bytes // 2)
    toks = np.random.default_rng(blocks).integers(0, 100_000, blocks * T)
    for first in range(0, blocks, per_call):
        n = min(per_call, blocks - first)
        kv = LAYOUT.random_kv(n * T, seed=first)
        if ns.store(toks[: (first + n) * T], kv, start=first * T).wait() != n:
            raise AssertionError(f"stored fewer than {n} blocks")
    return ns, toks


def _only_on_nvme(cm: Any, ns: Any, toks: np.ndarray) -> None:
    from cmx.links import actor_name
    from cmx.tiers import Tier

    keys = [b.key for b in ns.lookup(toks).blocks]
    for tier in ("hbm", "dram"):
        cm.link.call(actor_name(tier, cm.node_id), Evict(keys=keys))
    where = [{c.tier for c in b.copies if c.node == cm.node_id} for b in ns.lookup(toks).blocks]
    if len(where) != len(toks) // LAYOUT.block_tokens or any(w != {Tier.NVME} for w in where):
        raise AssertionError("the prefix is not on this node's NVMe tier alone")


def _load(ns: Any, toks: np.ndarray) -> tuple[float, float]:
    """Wall and client CPU seconds of one load of the prefix."""
    c0, t0 = time.process_time(), time.perf_counter()
    got = ns.load(toks)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if got.shape[3] != len(toks):
        raise AssertionError(f"loaded {got.shape[3]} of {len(toks)} tokens")
    return dt, cpu


def pressure_figures(ctx: BenchContext, prefix_bytes: int = PREFIX_BYTES) -> list[Figure]:
    """The load's GB/s against fio's read of the same bytes, alternating in one run."""
    config = pressure_config(str(ctx.scratch("service-pressure")), prefix_bytes)
    loads, fio, cpu = [], [], []
    with bench_cluster(config) as bc:
        ctx.log(f"service: storing a {prefix_bytes // MiB} MiB prefix, HBM and DRAM "
                f"{config.hbm_bytes // MiB} MiB each")
        ns, toks = _store(bc.cm, prefix_bytes)
        _only_on_nvme(bc.cm, ns, toks)
        _load(ns, toks)  # untimed: the client maps the HBM arena once
        for rep in range(ctx.config.reps):
            fio.append(fio_same_bytes(ctx, "read", LAYOUT.block_bytes, prefix_bytes) / GB)
            _only_on_nvme(bc.cm, ns, toks)
            ctx.drop_cache()
            wall, used = _load(ns, toks)
            loads.append(prefix_bytes / wall / GB)
            cpu.append(used)
            ctx.log(f"service: under pressure rep {rep + 1}/{ctx.config.reps}: load "
                    f"{loads[-1]:.2f} GB/s (client CPU {used:.2f} s), fio read {fio[-1]:.2f} "
                    f"GB/s, load average {os.getloadavg()[0]:.1f}")
    what = (f"{prefix_bytes // MiB} MiB prefix of {LAYOUT.block_bytes // MiB} MiB blocks, HBM "
            f"and DRAM {config.hbm_bytes // MiB} MiB each")
    return [Figure(
        "service", f"ContextMemory.load under memory pressure, {what}, from NVMe", "GB/s",
        tuple(loads), f"fio read, same bytes, bs {LAYOUT.block_bytes // MiB} MiB QD16 O_DIRECT, "
        "alternating with the loads", tuple(fio), Goal(">=", GOAL),
        note=f"the client's CPU time per load (copy out, checks, calls): {median(cpu):.2f} s")]


def run_pressure(ctx: BenchContext) -> SuiteResult:
    """Suite "pressure": the memory-pressure load alone (``service`` runs it among others)."""
    result = SuiteResult("pressure", command="")
    result.figures += pressure_figures(ctx)
    return result
