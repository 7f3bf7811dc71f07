"""``cmx simulate``: a discrete-event model of a cluster driving the service's own policies.

    hardware   models, GPUs, tiers, nodes, network; the seed article's defaults
    workload   request traces: contexts, shared prefixes, tenants, bursts
    strategy   how a system moves KV: ours, and an LMCache-like one
    links      shared resources and the time of one transfer over a path
    cache      one tier of one node, ordered by the service's eviction policy
    agent      a node's offload agent: the service's queue discipline (policies.queueing)
    cluster    nodes, replicas, the directory, pool owners
    movement   loads, stores, demotions, pool writes
    engine     the event loop and a request's life (collector: the GC's pace while it runs)
    probe      what a run measures, and the typed result
    scenarios  the named workloads of the command
    report     the table, JSON and plots
    capacity   the highest request rate a strategy sustains at a TTFT p99 target, per seed
    cli        the ``cmx simulate`` command
    calibrate  this machine's tier speeds, the service's load times under 1-16 clients, and
               the prediction, medians against medians (calibrate_service: the loads on an
               embedded cluster; calibrate_predict: concurrent loads in the simulator;
               calibrate_nixl: NIXL between two processes; calibrate_docs: its section of
               docs/BENCHMARKS.md)
"""

from __future__ import annotations

from cmx.simulate.cluster import ClusterSpec
from cmx.simulate.engine import SimConfig, Simulator
from cmx.simulate.hardware import LLAMA3_8B, LLAMA3_70B, GpuSpec, ModelSpec, NodeSpec, TierSpec
from cmx.simulate.probe import SimResult
from cmx.simulate.scenarios import SCENARIOS, scenario
from cmx.simulate.strategy import CMX, LMCACHE_LIKE, Strategy
from cmx.simulate.workload import TenantSpec, WorkloadSpec

__all__ = [
    "CMX",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "LMCACHE_LIKE",
    "SCENARIOS",
    "ClusterSpec",
    "GpuSpec",
    "ModelSpec",
    "NodeSpec",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Strategy",
    "TenantSpec",
    "TierSpec",
    "WorkloadSpec",
    "scenario",
    "simulate",
]


def simulate(config: SimConfig) -> SimResult:
    """Run ``config`` to completion (every request finished)."""
    result: SimResult = Simulator(config).run()
    return result
