"""The calibration's prediction: N loads at once, through the simulator, on a few cores.

The links (the drive, the NIC) are the simulator's: a two-node cluster whose tiers have the
measured speeds runs N load jobs, submitted together on one node, through the same ``Mover``,
agent lanes and links as every simulation. The moves that are a CPU thread's work on a host
without a GPU (each block's checked copy into the client's fresh tensor, the agent's XXH3
checksum of what it read) run after a job's links, on a CPU shared by every load in flight:
``min(cores, N)`` threads, shared equally among the loads that have CPU work left (processor
sharing, as the kernel shares cores among threads), each at the speed measured alone, or,
when more than one runs, at the speed of each with a thread on every core copying out at
once (they share the memory's bandwidth).

Those moves are not all the CPU a load takes: the control path (Ray calls, actor hops, the
directory) runs on the same cores. So one load's own CPU-seconds, measured with one client
(the machine's busy CPU-seconds over the load, less what the machine keeps busy with no load
running: Ray, transfer threads that poll, neighbours, all of which yield to work), bound the
rest (``machine_bound``): N loads started together end no earlier than the cores could have
given them N times that.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cmx.simulate.calibrate import ControlCosts, MachineSpeeds

__all__ = ["cpu_seconds", "machine_bound", "predict_loads", "share_cpu"]

UNBOUNDED = 1e18  # bytes/s of a link whose move is counted as CPU work instead


def cpu_seconds(speeds: MachineSpeeds, source: str, nbytes: int, threads: int = 1) -> float:
    """One thread's seconds of CPU work in a load of ``nbytes`` from ``source``, with
    ``threads`` threads at work at once: the client's copy into its tensor, each block
    checked as it is copied (``cmx.client.copy_out``); for NVMe and peer reads, the agent's
    checksum of every block as it lands. A DRAM block is read where it lies, in the tier's
    shared-memory arena: no copy between arenas."""
    checksums = 0 if source == "dram" else 1
    return nbytes / speeds.copy_out_at(threads) + checksums * nbytes / speeds.checksum


def share_cpu(ready_s: Sequence[float], work_s: Sequence[float], threads: int) -> list[float]:
    """When each job's CPU work ends: job ``i`` is ready at ``ready_s[i]`` with ``work_s[i]``
    seconds of one thread's work; the ``k`` jobs with work left each run at
    ``min(1, threads / k)`` of a thread."""
    if threads < 1 or len(ready_s) != len(work_s):
        raise ValueError(f"threads {threads} < 1 or {len(ready_s)} ready != {len(work_s)} work")
    order = sorted(range(len(ready_s)), key=lambda i: ready_s[i])
    left = [float(w) for w in work_s]
    end = [math.nan] * len(left)
    active: list[int] = []
    t, nxt = 0.0, 0
    while nxt < len(order) or active:
        if not active:
            t = max(t, ready_s[order[nxt]])
        while nxt < len(order) and ready_s[order[nxt]] <= t:
            active.append(order[nxt])
            nxt += 1
        rate = min(1.0, threads / len(active))
        first = min(active, key=lambda i: left[i])
        finish = t + left[first] / rate
        arrival = ready_s[order[nxt]] if nxt < len(order) else math.inf
        stop = min(finish, arrival)
        for i in active:
            left[i] -= (stop - t) * rate
        left[first] = 0.0 if finish <= arrival else left[first]
        t = stop
        for i in [i for i in active if left[i] <= 1e-12 * max(1.0, work_s[i])]:
            end[i] = t
            active.remove(i)
    return end


def predict_loads(speeds: MachineSpeeds, control: ControlCosts, source: str, blocks: int,
                  block_bytes: int, clients: int = 1, cores: int = 1) -> list[float]:
    """Seconds each of ``clients`` loads of ``blocks`` blocks from ``source`` takes, all
    submitted at once on node a: its control cost per load and per block (one I/O per block),
    its links, then its CPU work on ``min(cores, clients)`` threads."""
    from cmx.simulate.agent import Priority
    from cmx.simulate.cluster import DRAM, NVME, ClusterSpec
    from cmx.simulate.engine import SimConfig, Simulator
    from cmx.simulate.hardware import LLAMA3_8B, GpuSpec, NetworkSpec, NodeSpec, TierSpec
    from cmx.simulate.strategy import CMX
    from cmx.simulate.workload import TenantSpec, WorkloadSpec

    big = 1 << 50
    node = NodeSpec(gpu=GpuSpec("host", big, UNBOUNDED, 1e12), gpus=1,
                    dram=TierSpec(big, UNBOUNDED, 0.0),
                    nvme=TierSpec(big, speeds.odirect_read, 0.0),
                    dram_bus_bandwidth=UNBOUNDED, nvme_write_bandwidth=speeds.odirect_read)
    tokens = block_bytes // LLAMA3_8B.kv_bytes_per_token
    # No CPU work in the strategy: it is shared below, across the loads.
    strategy = CMX.with_(control_s=control.fixed_s, per_io_cpu_s=control.per_block_s,
                         io_bytes=block_bytes, io_depth=16, verify_bandwidth=None,
                         consumer_verifies=False, copy_out_bandwidth=None)
    workload = WorkloadSpec((TenantSpec("calibration", context_tokens=(tokens, tokens)),),
                            rate_per_s=1e-3, duration_s=1.0)
    config = SimConfig(workload, ClusterSpec(2, node, NetworkSpec(speeds.nixl, 0.0), 0),
                       LLAMA3_8B, strategy, unit_tokens=tokens)
    sim = Simulator(config)
    here, there = sim.cluster.nodes
    holder, tier = {"dram": (here, DRAM), "nvme": (here, NVME), "dram@peer": (there, DRAM)}[source]
    linked: list[float] = []
    jobs = []
    for c in range(clients):
        keys = [b"calibration-%d-%d" % (c, i) for i in range(blocks)]
        for key in keys:
            sim.cluster.add_copy(key, holder, tier, block_bytes)
        job = sim.mover.load_job(here.replicas[0], [holder.index * 4 + tier] * blocks, keys,
                                 Priority.LOAD)
        job.waiters.append(linked.append)
        jobs.append(job)
    for job in jobs:
        sim.mover.submit(here.agent, job)
    # ``Simulator.time_load``'s loop, for N jobs: the engine has no call that runs several.
    while not all(job.finished for job in jobs):
        sim.now, _, handler, arg = heapq.heappop(sim._events)
        handler(arg)
    threads = min(cores, clients)
    work = cpu_seconds(speeds, source, blocks * block_bytes, threads)
    return share_cpu(linked, [work] * clients, threads)



def machine_bound(predicted_s: Sequence[float], cpu_per_load_s: float | None,
                  cores: int) -> list[float]:
    """``predicted_s``, each no less than the time ``cores`` take to supply every load's
    ``cpu_per_load_s`` (one load's own CPU-seconds, measured alone); unchanged where that was
    not measured."""
    if cores < 1:
        raise ValueError(f"cores {cores} < 1")
    if cpu_per_load_s is None:
        return list(predicted_s)
    floor = len(predicted_s) * cpu_per_load_s / cores
    return [max(t, floor) for t in predicted_s]
