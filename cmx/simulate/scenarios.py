"""Named workloads on named clusters: what ``cmx simulate`` runs.

- ``seed``: the seed article's study. Llama-3-8B, 64K-token contexts, 75% of each a prefix
  that other requests share; 4 nodes of 8 H100s, one replica per GPU.
- ``tutti``: the seed's measurement of a GPU-driven design against GDS-enabled LMCache.
  Llama-3-8B, 64K-token contexts with a 75% hit rate: each context's first 48K tokens are on
  every node's NVMe before the first request (64 prefixes), and neither HBM nor DRAM keeps a
  block, so every hit is read from the drive; the rest is computed. ``load`` sets the
  concurrency: near 0 a request has its replica and the drive to itself, as in a TTFT
  measurement; higher, the production concurrency the seed's GPU idle figure speaks of.
- ``mix``: three tenants on 16 nodes: chat (8K-32K, half shared, many prefixes), documents
  (128K, 90% shared) and agents (256K-1M, 75% shared, few long histories), with bursts of 4x
  the rate for 30 s every 5 minutes. Replicas of 4 GPUs, so a 1M-token context fits.
- ``scale``: 1,000 nodes (8,000 GPUs), 1M-token contexts, an hour of traffic, replicas of
  8 GPUs.

Every cluster has one pool node per 8 GPU nodes (at least 2).

The arrival rate is set by ``load``: the fraction of the replicas' time the requests would keep
busy if every shared prefix were loaded for free.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from cmx.simulate.cluster import ClusterSpec
from cmx.simulate.config import SimConfig
from cmx.simulate.hardware import MODELS, ModelSpec, NodeSpec, prefill_cost
from cmx.simulate.strategy import CMX, Strategy
from cmx.simulate.workload import TenantSpec, WorkloadSpec

__all__ = ["DEFAULT_LOAD", "SCENARIOS", "scenario"]

SCENARIOS = ("seed", "tutti", "mix", "scale")
# Every scenario runs at 0.7 unless it says otherwise. ``tutti`` reads 48K tokens (6.4 GB) a
# request from one 7 GB/s drive a node: at 0.2 the drives are about 0.96 busy, at 0.7 the
# queue for them grows for the whole run; at 0.05 (about 0.24) a request mostly has its
# drive to itself, as in the seed's measurement of one request's TTFT.
DEFAULT_LOAD = {"tutti": 0.05}


def _tenants(name: str) -> tuple[tuple[TenantSpec, ...], int, int]:
    """Tenants, GPUs per replica, tokens per simulated block."""
    if name == "seed":
        return (TenantSpec("seed", 1.0, (65_536, 65_536), 0.75, prefixes=512),), 1, 16_384
    if name == "tutti":
        return (TenantSpec("tutti", 1.0, (65_536, 65_536), 0.75, prefixes=64),), 1, 16_384
    if name == "mix":
        return (TenantSpec("chat", 6.0, (8_192, 32_768), 0.5, prefixes=2048),
                TenantSpec("docs", 3.0, (131_072, 131_072), 0.9, prefixes=256),
                TenantSpec("agents", 1.0, (262_144, 1_048_576), 0.75, prefixes=64)), 4, 8192
    if name == "scale":
        return (TenantSpec("long", 1.0, (1_048_576, 1_048_576), 0.75, prefixes=512),), 8, 131_072
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _service_s(tenants: tuple[TenantSpec, ...], model: ModelSpec, node: NodeSpec) -> float:
    """Mean seconds of a request's prefill with its shared prefix loaded for free."""
    cost = prefill_cost(model, node)
    total = sum(t.weight for t in tenants)
    out = 0.0
    for t in tenants:
        lo, hi = t.context_tokens
        ctx = lo if lo == hi else (hi - lo) / math.log(hi / lo)  # mean of a log-uniform
        out += t.weight / total * cost.seconds(int(ctx * t.shared_fraction), int(ctx))
    return out


def scenario(name: str, *, strategy: Strategy = CMX, nodes: int | None = None,
             duration_s: float | None = None, load: float | None = None,
             model: str | None = None, seed: int = 0,
             host_cores: int | None = None, process_threads: int = 1,
             routing: str = "least-loaded") -> SimConfig:
    """``load``: the scenario's ``DEFAULT_LOAD`` where None; ``host_cores``: each node's
    cores, for the node's default (``NodeSpec.host_cores``); ``process_threads``: each serving
    process's (``NodeSpec.process_threads``); ``routing``: ``routing.ROUTINGS``."""
    load = DEFAULT_LOAD.get(name, 0.7) if load is None else load
    if not 0 < load <= 4:
        raise ValueError(f"load must be in (0, 4], got {load}")
    tenants, per_replica, unit = _tenants(name)
    spec = MODELS.get(model or "llama-3-8b")
    if spec is None:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    if spec.name != "llama-3-8b":
        per_replica = max(per_replica, 4)  # 70B weights alone are 141 GB
    default_nodes = {"seed": 4, "tutti": 4, "mix": 16, "scale": 1000}[name]
    node = NodeSpec(process_threads=process_threads)
    if host_cores is not None:
        node = replace(node, host_cores=host_cores)
    if name == "tutti":
        node = replace(node, dram=replace(node.dram, capacity_bytes=0))
    cluster = ClusterSpec(nodes=nodes or default_nodes,
                          node=node.with_replicas_of(per_replica),
                          pool_nodes=max(2, (nodes or default_nodes) // 8))
    duration = duration_s or (3600.0 if name == "scale" else 600.0)
    rate = load * cluster.replicas / _service_s(tenants, spec, cluster.node)
    bursts: dict[str, Any] = {"burst_every_s": 300.0, "burst_len_s": 30.0,
                              "burst_factor": 4.0} if name == "mix" else {}
    workload = WorkloadSpec(tenants, rate, duration, seed=seed, **bursts)
    tutti = name == "tutti"
    return SimConfig(workload, cluster, spec, strategy, unit_tokens=unit, routing=routing,
                     warm_nvme=tutti, hbm_cache=not tutti)


def with_strategy(config: SimConfig, strategy: Strategy) -> SimConfig:
    """The same workload, cluster and model under another strategy."""
    return replace(config, strategy=strategy)
