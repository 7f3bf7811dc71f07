"""Figures of suite "service": a prefix larger than the node's HBM and DRAM, loaded from NVMe.

A 512 MiB prefix of 2 MiB blocks on a node whose HBM and DRAM tiers each hold an eighth of it:
the prefix is stored, evicted down to NVMe, and loaded window by window through HBM slots that
each window's blocks take in turn (``cmx.client.loads``), two ways: ``NamespaceClient.load``
(into a new tensor) and ``NamespaceClient.load_into`` (into the caller's warm buffer). The
baseline is fio's O_DIRECT sequential read of the same number of bytes (I/Os of one block,
QD16), measured in the same run, alternating with the loads (fio, load, fio, load_into, ...),
so both see the same minutes of a shared machine.

Beside them, the CPU budget of a ``load_into``: the CPU-seconds per GB each process took (the
client, the agent, each tier actor, the directory shards, and the rest of the Ray cluster),
read from ``/proc`` (``cmx.bench.harness.proc_cpu``) while it ran.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from cmx.bench.harness.cluster import bench_cluster
from cmx.bench.harness.core import GB, BenchContext, Figure, GiB, Goal, MiB, SuiteResult, median
from cmx.bench.harness.intervals import ratio_interval
from cmx.bench.harness.proc_cpu import REST, CpuMeter, CpuUse
from cmx.bench.suites.hits.nvme_hits import fio_same_bytes
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


def _only_on_nvme(cm: Any, ns: Any, toks: np.ndarray, settle_s: float = 10.0) -> None:
    """Evict the prefix from this node's HBM and DRAM. A load's last releases are sent
    without waiting, so a block may still be pinned a moment after it returns: evicted again
    until it is not, for at most ``settle_s``."""
    from cmx.links import actor_name
    from cmx.tiers import Tier

    keys = [b.key for b in ns.lookup(toks).blocks]
    deadline = time.monotonic() + settle_s
    while True:
        for tier in ("hbm", "dram"):
            cm.link.call(actor_name(tier, cm.node_id), Evict(keys=keys))
        where = [{c.tier for c in b.copies if c.node == cm.node_id}
                 for b in ns.lookup(toks).blocks]
        if len(where) == len(toks) // LAYOUT.block_tokens and all(w == {Tier.NVME}
                                                                   for w in where):
            return
        if time.monotonic() > deadline:
            raise AssertionError("the prefix is not on this node's NVMe tier alone")
        time.sleep(0.1)


def _load(ns: Any, toks: np.ndarray, into: Any = None) -> tuple[float, float]:
    """Wall and client CPU seconds of one load of the prefix: ``ns.load``, or with ``into``
    ``ns.load_into`` that buffer."""
    c0, t0 = time.process_time(), time.perf_counter()
    got = ns.load(toks).shape[3] if into is None else ns.load_into(toks, into)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if got != len(toks):
        raise AssertionError(f"loaded {got} of {len(toks)} tokens")
    return dt, cpu


def _actor_pids(bc: Any) -> dict[str, Iterable[int]]:
    """The pid of each of the service's actors on the bench node, by role."""
    import ray

    from cmx.links import RAY_NAMESPACE, actor_name

    node = bc.cm.node_id
    names = {"agent": [actor_name("agent", node)],
             **{f"{label} tier": [actor_name(t, node)]
                for t, label in (("hbm", "HBM"), ("dram", "DRAM"), ("nvme", "NVMe"))},
             "directory": [actor_name("dir", i) for i in range(bc.config.directory_shards)]}
    refs = {role: [ray.get_actor(n, namespace=RAY_NAMESPACE).__ray_call__.remote(
                       lambda _: os.getpid()) for n in ns]
            for role, ns in names.items()}
    return {role: ray.get(r, timeout=60) for role, r in refs.items()}


def _budget(uses: list[CpuUse], client_s: list[float], nbytes: int) -> str:
    """The median CPU-seconds per GB of each process (the client's from its own clock: the
    meter counts it with the rest of the cluster it started)."""
    gb = nbytes / GB
    roles = {"client": [c / gb for c in client_s]}
    for role in uses[0].groups:
        per = [u.groups[role] for u in uses]
        if role == REST:
            per = [max(0.0, p - c) for p, c in zip(per, client_s)]
            role = "the rest of the Ray cluster"
        roles[role] = [p / gb for p in per]
    total = [sum(r[i] for r in roles.values()) for i in range(len(uses))]
    parts = ", ".join(f"{role} {median(v):.2f}" for role, v in roles.items())
    return f"CPU-s per GB of a load_into, by process (medians): {parts}; all {median(total):.2f}"


def pressure_figures(ctx: BenchContext, prefix_bytes: int = PREFIX_BYTES) -> list[Figure]:
    """``load`` and ``load_into`` GB/s, each against fio's read of the same bytes just before
    it, alternating in one run; the CPU budget of ``load_into`` by process."""
    from cmx.client.copy_out import empty_kv

    config = pressure_config(str(ctx.scratch("service-pressure")), prefix_bytes)
    speed: dict[str, list[float]] = {"load": [], "load_into": []}
    fio: dict[str, list[float]] = {"load": [], "load_into": []}
    cpu: dict[str, list[float]] = {"load": [], "load_into": []}
    uses: list[CpuUse] = []
    with bench_cluster(config) as bc:
        ctx.log(f"service: storing a {prefix_bytes // MiB} MiB prefix, HBM and DRAM "
                f"{config.hbm_bytes // MiB} MiB each")
        ns, toks = _store(bc.cm, prefix_bytes)
        roles = _actor_pids(bc)
        warm = empty_kv(LAYOUT, len(toks))
        for way in ("load", "load_into"):  # untimed: the client maps the HBM arena once
            _only_on_nvme(bc.cm, ns, toks)
            _load(ns, toks, warm if way == "load_into" else None)
        for rep in range(ctx.config.reps):
            for way in ("load", "load_into"):
                fio[way].append(fio_same_bytes(ctx, "read", LAYOUT.block_bytes,
                                               prefix_bytes) / GB)
                _only_on_nvme(bc.cm, ns, toks)
                ctx.drop_cache()
                with CpuMeter(roles, interval_s=0.1) as meter:
                    wall, used = _load(ns, toks, warm if way == "load_into" else None)
                if way == "load_into" and meter.use is not None:
                    uses.append(meter.use)
                speed[way].append(prefix_bytes / wall / GB)
                cpu[way].append(used)
                ctx.log(f"service: under pressure rep {rep + 1}/{ctx.config.reps}: {way} "
                        f"{speed[way][-1]:.2f} GB/s (client CPU {used:.2f} s), fio read "
                        f"{fio[way][-1]:.2f} GB/s, load average {os.getloadavg()[0]:.1f}")
    what = (f"{prefix_bytes // MiB} MiB prefix of {LAYOUT.block_bytes // MiB} MiB blocks, HBM "
            f"and DRAM {config.hbm_bytes // MiB} MiB each")
    baseline = (f"fio read, same bytes, bs {LAYOUT.block_bytes // MiB} MiB QD16 O_DIRECT, "
                "just before each load")
    return [
        Figure("service", f"ContextMemory.load under memory pressure, {what}, from NVMe, into "
               "a new tensor", "GB/s", tuple(speed["load"]), baseline, tuple(fio["load"]),
               Goal(">=", GOAL), note=f"the client's CPU time per load (copy out, checks, "
               f"calls): {median(cpu['load']):.2f} s",
               interval=ratio_interval(speed["load"], fio["load"])),
        Figure("service", f"load_into under memory pressure, {what}, from NVMe, into the "
               "caller's warm buffer", "GB/s", tuple(speed["load_into"]), baseline,
               tuple(fio["load_into"]), Goal(">=", GOAL),
               note=_budget(uses, cpu["load_into"], prefix_bytes),
               interval=ratio_interval(speed["load_into"], fio["load_into"])),
    ]


def run_pressure(ctx: BenchContext) -> SuiteResult:
    """Suite "pressure": the memory-pressure load alone (``service`` runs it among others)."""
    result = SuiteResult("pressure", command="")
    result.figures += pressure_figures(ctx)
    return result
