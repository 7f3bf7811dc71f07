"""What a run measures: per request, per tier, per agent, over time; and the typed result.

``Probe`` records as the loop runs (numpy arrays, one slot per request; one row per sample),
and ``result`` folds it into a frozen ``SimResult``: what the table, the JSON and the plots show.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cmx.simulate.cluster import DRAM, HBM, NVME, POOL, Cluster
from cmx.simulate.config import SimConfig
from cmx.simulate.movement import Traffic
from cmx.simulate.request import Req

__all__ = ["Distribution", "Probe", "SimResult", "TierStats"]


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, x: np.ndarray) -> Distribution:
        if not len(x):
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        p = np.percentile(x, [50, 90, 99])
        return cls(float(x.mean()), float(p[0]), float(p[1]), float(p[2]), float(x.max()))


@dataclass(frozen=True)
class TierStats:
    tier: str
    capacity_bytes: int  # summed over the nodes that have the tier
    used_bytes: int  # at the end
    peak_bytes: int  # the largest sample
    written_bytes: int  # committed into the tier over the run
    evictions: int
    hits: int  # loads served from it


@dataclass(frozen=True)
class SimResult:
    strategy: str
    model: str
    nodes: int
    gpus: int
    replicas: int
    requests: int
    completed: int
    duration_s: float  # of arrivals
    end_s: float  # simulated time the last request finished
    ttft_s: Distribution
    queue_s: Distribution  # arrival to start on a replica
    io_wait_s: Distribution  # start to compute: the GPU idle, waiting on KV I/O
    io_wait_fraction: float  # of the GPUs' busy time (waiting + computing)
    # of the GPUs' busy time: waiting on KV whose bytes had arrived, on the CPU work of its
    # I/Os (issuing them, copying and checking what they moved)
    io_cpu_wait_fraction: float
    # of the GPUs' busy time: a prefill's GPU work done, its host work not yet (cores busy)
    cpu_wait_fraction: float
    host_cpu_utilization: float  # of the GPU nodes' cores, over the run
    # of the serving processes' threads (``NodeSpec.process_threads`` each), over the run
    process_cpu_utilization: float
    cached_fraction: float  # of context tokens found cached at arrival
    loaded_fraction: float  # of context tokens loaded (the plan's cut, and refused loads')
    cut: int  # requests whose load the agent refused: they recomputed everything
    late: int  # requests whose prefetch missed the deadline: their own load overtook it
    loaded_bytes: dict[str, int]  # by source class
    stored_bytes: int
    demoted_bytes: int
    pooled_bytes: int
    network_bytes: int
    dropped_jobs: int
    unplaced_blocks: int
    tiers: tuple[TierStats, ...]
    queue_depth_max: int  # the most jobs queued at one agent
    queue_depth_mean: float  # per agent, time-weighted
    events: int
    wall_s: float
    cpu_s: float  # this process's CPU time: what the run costs on a machine others share
    series: dict[str, list[float]] = field(repr=False)
    ttft_samples: tuple[float, ...] = field(repr=False, default=())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("ttft_samples")
        return out


class Probe:
    def __init__(self, arrival_s: np.ndarray, cluster: Cluster, config: SimConfig) -> None:
        n = len(arrival_s)
        self.cluster = cluster
        self.config = config
        self.arrival_s = np.asarray(arrival_s, dtype=float)
        self.ttft = np.full(n, np.nan)
        self.queue = np.zeros(n)
        self.io_wait = np.zeros(n)
        self.cpu_wait = np.zeros(n)
        self.cpu_io_wait = np.zeros(n)
        self.found = np.zeros(n, np.int64)
        self.planned_load = np.zeros(n, np.int64)  # tokens a load job moves (cut or not)
        self.loaded = np.zeros(n, np.int64)
        self.context = np.zeros(n, np.int64)
        self.patience_s = np.zeros(n)
        self.cuts = 0
        self.late = 0
        self.rows: list[tuple[float, ...]] = []
        self.peak = [0, 0, 0, 0]

    def planned(self, i: int, found_tokens: int, load_tokens: int, patience_s: float) -> None:
        self.found[i] = found_tokens
        self.planned_load[i] = load_tokens
        self.patience_s[i] = patience_s

    def arrival(self, i: int) -> float:
        return float(self.arrival_s[i])

    def patience(self, i: int) -> float:
        return float(self.patience_s[i])

    def request(self, r: Req, now: float, loaded_tokens: int) -> None:
        i = r.i
        self.ttft[i] = now - self.arrival_s[i]
        self.queue[i] = r.start - self.arrival_s[i]
        self.io_wait[i] = r.compute_start - r.start
        self.cpu_wait[i] = max(0.0, now - r.compute_start - r.gpu_s)
        self.cpu_io_wait[i] = r.cpu_io_wait
        self.loaded[i] = loaded_tokens
        self.context[i] = r.context
        self.cuts += r.cut
        self.late += r.late

    def sample(self, now: float) -> None:
        used = [0, 0, 0, 0]
        queued = running = 0
        for node in self.cluster.all_nodes:
            for tier in (HBM, DRAM, NVME, POOL):
                cache = node.caches[tier]
                if cache is not None:
                    used[tier] += cache.used
            queued += node.agent.queued
            running += node.agent.running
        work = sum(r.hbm_used for r in self.cluster.replicas)
        self.peak = [max(a, b) for a, b in zip(self.peak, used)]
        self.rows.append((now, work, *used, queued, running))

    def result(self, now: float, traffic: Traffic, events: int, wall_s: float,
               cpu_s: float) -> SimResult:
        """The run's result at its end, simulated time ``now``, with what its moves carried."""
        cfg, cluster = self.config, self.cluster
        done = ~np.isnan(self.ttft)
        ctx = self.context[done].sum()
        compute = self.ttft[done] - self.queue[done] - self.io_wait[done]
        busy = compute.sum() + self.io_wait[done].sum()
        self.sample(now)
        series = {name: [row[k] for row in self.rows] for k, name in enumerate(
            ("t_s", "hbm_work_bytes", "hbm_bytes", "dram_bytes", "nvme_bytes", "pool_bytes",
             "queued", "running"))}
        agents = [n.agent for n in cluster.all_nodes]
        for agent in agents:
            agent.advance(now)
        span = max(now, 1e-9)
        return SimResult(
            strategy=cfg.strategy.name, model=cfg.model.name, nodes=cfg.cluster.nodes,
            gpus=cfg.cluster.gpus, replicas=cfg.cluster.replicas, requests=len(self.ttft),
            completed=int(done.sum()), duration_s=cfg.workload.duration_s, end_s=now,
            ttft_s=Distribution.of(self.ttft[done]), queue_s=Distribution.of(self.queue[done]),
            io_wait_s=Distribution.of(self.io_wait[done]),
            io_wait_fraction=float(self.io_wait[done].sum() / busy) if busy > 0 else 0.0,
            io_cpu_wait_fraction=float(self.cpu_io_wait[done].sum() / busy) if busy > 0 else 0.0,
            cpu_wait_fraction=float(self.cpu_wait[done].sum() / busy) if busy > 0 else 0.0,
            host_cpu_utilization=self._cpu_utilization(span),
            process_cpu_utilization=self._process_utilization(span),
            cached_fraction=float(self.found[done].sum() / ctx) if ctx else 0.0,
            loaded_fraction=float(self.loaded[done].sum() / ctx) if ctx else 0.0,
            cut=self.cuts, late=self.late, loaded_bytes=dict(sorted(traffic.loaded.items())),
            stored_bytes=traffic.stored, demoted_bytes=traffic.demoted,
            pooled_bytes=traffic.pooled, network_bytes=traffic.network,
            dropped_jobs=traffic.dropped_jobs, unplaced_blocks=traffic.unplaced,
            tiers=self._tiers(), queue_depth_max=max(a.max_queued for a in agents),
            queue_depth_mean=sum(a.area for a in agents) / span / len(agents),
            events=events, wall_s=wall_s, cpu_s=cpu_s, series=series,
            ttft_samples=tuple(self.ttft[done].tolist()))

    def _cpu_utilization(self, span: float) -> float:
        cores = [n.cpu for n in self.cluster.nodes]
        return sum(c.busy_s for c in cores) / (span * sum(c.count for c in cores))

    def _process_utilization(self, span: float) -> float:
        given = threads = 0.0
        for node in self.cluster.nodes:
            for process, busy in node.cpu.process_busy_s.items():
                given += busy
                threads += node.cpu.threads(process)
        return given / (span * threads) if threads else 0.0

    def _tiers(self) -> tuple[TierStats, ...]:
        out = []
        for tier, name in ((HBM, "hbm"), (DRAM, "dram"), (NVME, "nvme"), (POOL, "pool")):
            caches = [n.caches[tier] for n in self.cluster.all_nodes if n.caches[tier]]
            if not caches:
                continue
            out.append(TierStats(
                name, sum(c.capacity for c in caches if c), sum(c.used for c in caches if c),
                self.peak[tier], sum(c.bytes_in for c in caches if c),
                sum(c.evictions for c in caches if c), sum(c.hits for c in caches if c)))
        return tuple(out)
