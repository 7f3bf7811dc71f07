"""A local multi-node Ray cluster with the service on it, for the suites that need one.

Node "a" stores, node "b" loads; optional pool nodes. One cluster per suite, shut down after.
``LLAMA`` and ``SMALL`` are the geometries of the suites' prefixes, and ``store_prefix`` stores
one through the cluster's client.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmx.config import ServiceConfig
from cmx.layout import KVLayout

__all__ = ["LLAMA", "SMALL", "BenchCluster", "bench_cluster", "on_node", "store_prefix"]

LLAMA = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256)
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)


@dataclass
class BenchCluster:
    cluster: Any
    cm: Any  # ContextMemory of the driver, on node "a"
    node_a: str
    node_b: str
    pool: list[str]
    config: ServiceConfig


@contextmanager
def bench_cluster(config: ServiceConfig, pool_nodes: int = 0) -> Iterator[BenchCluster]:
    import ray
    from ray.cluster_utils import Cluster

    from cmx.client import ContextMemory

    if ray.is_initialized():
        raise RuntimeError("a bench suite with a cluster must run in a process without Ray")
    root = tempfile.mkdtemp(prefix="cmx-bench-nvme-", dir=config.nvme_dir)
    config = config.replace(nvme_dir=root)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    b = c.add_node(num_cpus=1)
    pool = [c.add_node(num_cpus=0, labels={config.pool_label: f"bench-p{i}"})
            for i in range(pool_nodes)]
    c.wait_for_nodes()
    try:
        ray.init(address=c.address, namespace="cmx", log_to_driver=False)
        cm = ContextMemory.connect(address=c.address, config=config)
        try:
            yield BenchCluster(c, cm, cm.node_id, b.node_id, [p.node_id for p in pool], config)
        finally:
            cm.shutdown(stop_service=True)
            ray.shutdown()
    finally:
        c.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def on_node(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def store_prefix(cm: Any, layout: KVLayout, blocks: int, seed: int) -> tuple[Any, np.ndarray]:
    """``blocks`` blocks of ``layout`` stored through ``cm`` in namespace ``s{seed}``, from
    tokens and KV drawn from ``seed``: the namespace and the tokens."""
    ns = cm.namespace("bench", layout, f"s{seed}")
    toks = np.random.default_rng(seed).integers(0, 100_000, blocks * layout.block_tokens)
    T = layout.block_tokens
    for first in range(0, blocks, 8):  # bounded memory: 8 blocks of KV at a time
        n = min(8, blocks - first)
        kv = layout.random_kv(n * T, seed=seed + first)
        ns.store(toks[: (first + n) * T], kv, start=first * T).wait()
    return ns, toks
