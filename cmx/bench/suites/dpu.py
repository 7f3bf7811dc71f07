"""Suite "dpu": loads through the node's agent on its host, and on a DPU reaching it over NIXL.

Two local Ray clusters, one after the other, each a host node (and a client on it) and a
peer host node (with a client of its own):

- host: the agent runs on the host node, maps its arenas, opens its NVMe files;
- DPU: a node labelled as the host's DPU joins; the agent runs there with
  ``dpu_access="nixl"``: every byte through NIXL (UCX to the host's arenas through a bounce
  buffer on the DPU side, NVMe extents through the host endpoint's POSIX backend, blocks
  between nodes through the NIXL transport).

Per repetition, a new 32 MiB prefix (16 blocks of 2 MiB) is stored and loaded through
``NamespaceClient.load`` from the host's DRAM; another is stored, pushed out of DRAM by the
next stores (write-back demotes it to NVMe) and loaded from NVMe; one stored on the host is
loaded by the peer's client (the host's agent serves it), and one stored on the peer is
loaded on the host (the host's agent pulls it). Figures are the DPU agent's GB/s over the
host agent's, both measured in this run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from cmx.bench.harness.core import GB, BenchContext, Figure, MiB, SuiteResult, Table, median
from cmx.config import ServiceConfig
from cmx.layout import KVLayout

__all__ = ["run_dpu"]

LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16", block_tokens=32)
BLOCKS = 16  # one prefix: 16 blocks of 2 MiB
NOTES = {
    "dram": "the DPU agent moves each byte over UCX twice (into a bounce buffer, out to the "
            "host's HBM slot), two blocks in flight (one per bounce buffer)",
    "nvme": "the host endpoint reads each extent into its HBM slot (NIXL POSIX); the DPU agent "
            "reads the block back over UCX to verify its checksum",
    "peer-serve": "the peer's transport reads the host's DRAM slots over UCX; with the agent "
                  "on a DPU they are the host endpoint's registrations",
    "peer-pull": "the DPU agent's transport pulls each block into its bounce slots (8 at a "
                 "time), checks it, and writes it to the host's HBM slot over UCX: two "
                 "crossings against the host agent's one",
}
SOURCES = {"dram": "the host's DRAM", "nvme": "the host's NVMe",
           "peer-serve": "the host's DRAM by the peer node", "peer-pull": "the peer's DRAM"}


@contextmanager
def _cluster(config: ServiceConfig, dpu: bool) -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cmx.client import ContextMemory

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "labels": {config.host_label: "bench-host"}})
    if dpu:
        c.add_node(num_cpus=0, labels={config.dpu_label: "bench-dpu",
                                       config.host_label: "bench-host"})
    peer = c.add_node(num_cpus=1, labels={config.host_label: "bench-peer"})
    c.wait_for_nodes()
    try:
        ray.init(address=c.address, namespace="cmx", log_to_driver=False)
        cm = ContextMemory.connect(address=c.address, config=config)
        try:
            yield cm, ray.remote(PeerClient).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    peer.node_id, soft=False)).remote(config)
        finally:
            cm.shutdown(stop_service=True)
            ray.shutdown()
    finally:
        c.shutdown()


class PeerClient:
    """A client on the peer node (a Ray actor there): stores, and timed, checked loads."""

    def __init__(self, config: ServiceConfig) -> None:
        from cmx.client import ContextMemory

        self.cm = ContextMemory.connect(config=config, start_service=False)

    def store(self, seed: int) -> int:
        _store(self.cm, seed)
        return BLOCKS

    def load(self, seed: int, node: str) -> float:
        """Seconds of a load of ``seed``'s prefix, once every block shows on ``node``."""
        ns, toks, kv = _prefix(self.cm, seed)
        return _load(ns, toks, kv, node=node)


def _prefix(cm: Any, seed: int) -> tuple[Any, np.ndarray, Any]:
    ns = cm.namespace("bench-dpu", LAYOUT, f"s{seed}")
    toks = np.random.default_rng(seed).integers(0, 50_000, BLOCKS * LAYOUT.block_tokens)
    return ns, toks, LAYOUT.random_kv(len(toks), seed=seed)


def _store(cm: Any, seed: int) -> tuple[Any, np.ndarray, Any]:
    ns, toks, kv = _prefix(cm, seed)
    if ns.store(toks, kv).wait() != BLOCKS:
        raise AssertionError(f"stored fewer than {BLOCKS} blocks")
    return ns, toks, kv


def _load(ns: Any, toks: np.ndarray, kv: Any, tier: str = "dram", node: str = "") -> float:
    """Seconds of a checked load, once the directory shows every block in ``tier`` (on
    ``node``, if given)."""
    deadline = time.monotonic() + 120
    while True:
        blocks = ns.lookup(toks).blocks
        if len(blocks) == BLOCKS and {(b.tier.value, b.node if node else "") for b in blocks} \
                == {(tier, node)}:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefix did not settle in {tier} {node}")
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
        block_bytes=block, hbm_bytes=(3 * reps + 3) * BLOCKS * block,
        dram_bytes=2 * BLOCKS * block, nvme_bytes=(4 * reps + 4) * BLOCKS * block,
        nvme_dir=str(scratch), dpu_access="nixl", load_timeout_s=300, call_timeout_s=60)
    out: dict[str, list[float]] = {tier: [] for tier in SOURCES}
    with _cluster(config, dpu) as (cm, peer):
        import ray

        seed = 1000 if dpu else 0
        peer_node = ray.get(peer.__ray_call__.remote(lambda p: p.cm.node_id), timeout=120)
        _load(*_store(cm, seed), "dram")  # warm: connections, code, page faults
        _peer_round(cm, peer, seed + 8, peer_node)  # its seeds 8 and 9 are no rep's
        for rep in range(reps):
            ctx.log(f"dpu: {'DPU' if dpu else 'host'} agent, repetition {rep + 1}/{reps}")
            cold = _store(cm, seed + 10 * rep + 1)
            _store(cm, seed + 10 * rep + 2)  # with the next: DRAM turns over, cold goes down
            _store(cm, seed + 10 * rep + 3)
            out["nvme"].append(_load(*cold, "nvme"))
            out["dram"].append(_load(*_store(cm, seed + 10 * rep + 4), "dram"))
            serve, pull = _peer_round(cm, peer, seed + 10 * rep + 6, peer_node)
            out["peer-serve"].append(serve)
            out["peer-pull"].append(pull)
    return out


def _peer_round(cm: Any, peer: Any, seed: int, peer_node: str) -> tuple[float, float]:
    """Seconds of the peer's load of a prefix stored here, and of this node's load of one
    stored on the peer; each checked."""
    import ray

    _store(cm, seed)
    serve = float(ray.get(peer.load.remote(seed, cm.node_id), timeout=600))
    ray.get(peer.store.remote(seed + 1), timeout=600)
    pull = _load(*_prefix(cm, seed + 1), node=peer_node)
    return serve, pull


def run_dpu(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("dpu", command="")
    host = _measure(ctx, ctx.scratch("dpu-host"), dpu=False)
    dpu = _measure(ctx, ctx.scratch("dpu-dpu"), dpu=True)
    nbytes = BLOCKS * LAYOUT.block_bytes
    rows = []
    for tier, source in SOURCES.items():
        on_host = tuple(nbytes / s / GB for s in host[tier])
        on_dpu = tuple(nbytes / s / GB for s in dpu[tier])
        result.figures.append(Figure(
            "dpu", f"load of {nbytes // MiB} MiB from {source}, agent on a DPU over NIXL",
            "GB/s", on_dpu, "the same load, agent on the host", on_host, note=NOTES[tier]))
        rows.append((tier, f"{median(on_host):.2f}", f"{median(on_dpu):.2f}",
                     f"{median(host[tier]) * 1e3:.1f}", f"{median(dpu[tier]) * 1e3:.1f}"))
    result.tables.append(Table(
        f"ContextMemory.load of {nbytes // MiB} MiB ({BLOCKS} blocks of "
        f"{LAYOUT.block_bytes // MiB} MiB), medians of {ctx.config.reps}",
        ("source", "host agent GB/s", "DPU agent GB/s", "host agent ms", "DPU agent ms"),
        tuple(rows)))
    return result
