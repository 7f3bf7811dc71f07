"""Small clusters and workloads that run in a fraction of a second."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cmx.simulate import CMX, ClusterSpec, NodeSpec, SimConfig, Strategy, TierSpec
from cmx.simulate.hardware import GiB
from cmx.simulate.workload import TenantSpec, WorkloadSpec


def small_config(strategy: Strategy = CMX, *, seed: int = 0, dram_gib: int = 64,
                 shared: float = 0.75, rate: float = 6.0, duration_s: float = 60.0,
                 nodes: int = 2, pool_nodes: int = 2, **node: object) -> SimConfig:
    tenant = TenantSpec("t", context_tokens=(16_384, 65_536), shared_fraction=shared,
                        prefixes=16)
    spec = NodeSpec(gpus=4, dram=TierSpec(dram_gib * GiB, 63e9, 50e-6),
                    nvme=TierSpec(512 * GiB, 7e9, 300e-6), **node)  # type: ignore[arg-type]
    return SimConfig(WorkloadSpec((tenant,), rate, duration_s, seed=seed),
                     ClusterSpec(nodes=nodes, node=spec, pool_nodes=pool_nodes), strategy=strategy,
                     unit_tokens=4096, samples=20)


@pytest.fixture
def make_config() -> Callable[..., SimConfig]:
    return small_config
