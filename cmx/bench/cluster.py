"""A local multi-node Ray cluster with the service on it, for the suites that need one.

Node "a" stores, node "b" loads; optional pool nodes. One cluster per suite, shut down after.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cmx.config import ServiceConfig

__all__ = ["BenchCluster", "bench_cluster", "on_node"]


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
