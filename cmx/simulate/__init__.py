"""``cmx simulate``: a discrete-event model of a cluster driving the service's own policies.

The model is the modules at the top of this package, and it imports nothing around it: the
named scenarios, the capacity search, the reports, the command and the calibration
(``calibrate/``) drive it and write what it finds.

The model:

    hardware   models, GPUs, tiers, nodes, network; the seed article's defaults
    workload   request traces: contexts, shared prefixes, tenants, bursts
    strategy   how a system moves KV: ours, and an LMCache-like one
    links      shared resources and the time of one transfer over a path
    cores      a node's host cores, shared by the CPU work of its moves
    cache      one tier of one node, ordered by the service's eviction policy
    agent      a node's offload agent: the service's queue discipline (policies.queueing)
    cluster    nodes, replicas, the directory, pool owners
    movement   loads, stores, demotions, pool writes
    lookup     a request's cached prefix: each block's best copy, and the plan to load it
    routing    how a request finds its replica
    config     what a run is given (``SimConfig``)
    request    one request's state as the loop moves it
    probe      what a run measures, and the typed result
    engine     the event loop and a request's life (collector: the GC's pace while it runs)

Around it:

    scenarios  the named workloads of the command
    capacity   the highest request rate a strategy sustains at a TTFT p99 target, per seed
    report     the table, JSON and plots of runs and of capacities
    cli        the ``cmx simulate`` command
    calibrate  this machine's tier speeds, the service's load times under 1-16 clients, and
               the prediction, medians against medians, and its section of docs/BENCHMARKS.md
"""

from __future__ import annotations

from cmx.simulate.cluster import ClusterSpec
from cmx.simulate.config import SimConfig
from cmx.simulate.engine import Simulator
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
