"""Suite "dpu": loads through the node's agent on its host, and on a DPU reaching it over NIXL.

Two local Ray clusters, one after the other, each a host node (and a client on it):

- host: the agent runs on the host node, maps its arenas, opens its NVMe files;
- DPU: a node labelled as the host's DPU joins; the agent runs there with
  ``dpu_access="nixl"``: every byte through NIXL (UCX to the host's arenas through a bounce
  buffer on the DPU side, NVMe extents through the host endpoint's POSIX backend).

Per repetition, a new 32 MiB prefix (16 blocks of 2 MiB) is stored and loaded through
``ContextMemory.load`` from the host's DRAM; another is stored, pushed out of DRAM by the
next stores (write-back demotes it to NVMe) and loaded from NVMe. Figures are the DPU
agent's GB/s over the host agent's, both measured in this run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from cmx.bench.core import GB, BenchContext, Figure, MiB, SuiteResult, Table, median
from cmx.config import ServiceConfig
from cmx.layout import KVLayout

__all__ = ["run_dpu"]

LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=32)
BLOCKS = 16  # one prefix: 16 blocks of 2 MiB
NOTES = {
    "dram": "the DPU agent moves each byte over UCX twice (into its bounce buffer, out to the "
            "host's HBM slot), one block at a time",
    "nvme": "the host endpoint reads each extent into its HBM slot (NIXL POSIX); the DPU agent "
            "reads the block back over UCX to verify its checksum",
}


@contextmanager
def _cluster(config: ServiceConfig, dpu: bool) -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    from cmx.client import ContextMemory

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "labels": {config.host_label: "bench-host"}})
    if dpu:
        c.add_node(num_cpus=0, labels={config.dpu_label: "bench-dpu",
                                       config.host_label: "bench-host"})
    c.wait_for_nodes()
    try:
        ray.init(address=c.address, namespace="cmx", log_to_driver=False)
        cm = ContextMemory.connect(address=c.address, config=config)
        try:
            yield cm
        finally:
            cm.shutdown(stop_service=True)
            ray.shutdown()
    finally:
        c.shutdown()


def _store(cm: Any, seed: int) -> tuple[Any, np.ndarray, Any]:
    ns = cm.namespace("bench-dpu", LAYOUT, f"s{seed}")
    toks = np.random.default_rng(seed).integers(0, 50_000, BLOCKS * LAYOUT.block_tokens)
    kv = LAYOUT.random_kv(len(toks), seed=seed)
    if ns.store(toks, kv).wait() != BLOCKS:
        raise AssertionError(f"stored fewer than {BLOCKS} blocks")
    return ns, toks, kv


def _load(ns: Any, toks: np.ndarray, kv: Any, tier: str) -> float:
    deadline = time.monotonic() + 120
    while {b.tier.value for b in ns.lookup(toks).blocks} != {tier}:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefix did not settle in {tier}")
        time.sleep(0.2)
    t0 = time.perf_counter()
    out = ns.load(toks)
    seconds = time.perf_counter() - t0
    if not out.equal(kv):
        raise AssertionError("a load returned other bytes than were stored")
    return seconds


def _measure(ctx: BenchContext, scratch: Path, dpu: bool) -> dict[str, list[float]]:
    block = LAYOUT.block_bytes
    reps = ctx.config.reps
    config = ServiceConfig(
        block_bytes=block, hbm_bytes=(2 * reps + 2) * BLOCKS * block,
        dram_bytes=2 * BLOCKS * block, nvme_bytes=(4 * reps + 4) * BLOCKS * block,
        nvme_dir=str(scratch), dpu_access="nixl", load_timeout_s=300, call_timeout_s=60)
    out: dict[str, list[float]] = {"dram": [], "nvme": []}
    with _cluster(config, dpu) as cm:
        seed = 1000 if dpu else 0
        _load(*_store(cm, seed), "dram")  # warm: connections, code, page faults
        for rep in range(reps):
            ctx.log(f"dpu: {'DPU' if dpu else 'host'} agent, repetition {rep + 1}/{reps}")
            cold = _store(cm, seed + 10 * rep + 1)
            _store(cm, seed + 10 * rep + 2)  # with the next: DRAM turns over, cold goes down
            _store(cm, seed + 10 * rep + 3)
            out["nvme"].append(_load(*cold, "nvme"))
            out["dram"].append(_load(*_store(cm, seed + 10 * rep + 4), "dram"))
    return out


def run_dpu(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("dpu", command="")
    host = _measure(ctx, ctx.scratch("dpu-host"), dpu=False)
    dpu = _measure(ctx, ctx.scratch("dpu-dpu"), dpu=True)
    nbytes = BLOCKS * LAYOUT.block_bytes
    rows = []
    for tier in ("dram", "nvme"):
        on_host = tuple(nbytes / s / GB for s in host[tier])
        on_dpu = tuple(nbytes / s / GB for s in dpu[tier])
        result.figures.append(Figure(
            "dpu", f"load of {nbytes // MiB} MiB from the host's {tier.upper()}, agent on a DPU "
                   "over NIXL", "GB/s", on_dpu, "the same load, agent on the host", on_host,
            note=NOTES[tier]))
        rows.append((tier, f"{median(on_host):.2f}", f"{median(on_dpu):.2f}",
                     f"{median(host[tier]) * 1e3:.1f}", f"{median(dpu[tier]) * 1e3:.1f}"))
    result.tables.append(Table(
        f"ContextMemory.load of {nbytes // MiB} MiB ({BLOCKS} blocks of "
        f"{LAYOUT.block_bytes // MiB} MiB), medians of {ctx.config.reps}",
        ("source", "host agent GB/s", "DPU agent GB/s", "host agent ms", "DPU agent ms"),
        tuple(rows)))
    return result
