"""The calibration's prediction: N loads at once, through the simulator, on a few cores.

A two-node cluster whose tiers have the measured speeds runs N load jobs, submitted together
on one node, through the same ``Mover``, agent lanes, links and host cores as every
simulation. The moves that are a CPU thread's work on a host without a GPU (each block's
checked copy into the client's fresh tensor, the agent's XXH3 checksum of what it read) run
after a job's links on the node's cores (``cores.Cores``: shared equally among the loads
that have CPU work left, as the kernel shares cores among threads), each at the speed
measured alone, or, when more than one runs, at the speed of each with a thread on every
core copying out at once (they share the memory's bandwidth).

Those moves are not all the CPU a load takes: the control path (Ray calls, actor hops, the
directory) runs on the same cores, and the model charges it as a wait, not as CPU. So beside
each prediction the calibration reports a floor (``cpu_floor``), for information: N loads
started together end no earlier than the cores could give them N times one load's own
CPU-seconds, measured with one client (the machine's busy CPU-seconds over the load, less what
the machine keeps busy with no load running: Ray, transfer threads that poll, neighbours, all
of which yield to work). The floor is never put in place of the simulator's prediction: a
prediction below it shows CPU the model does not charge.
"""

from __future__ import annotations

import functools
import math

from cmx.simulate.agent import Priority
from cmx.simulate.calibrate.result import ControlCosts, MachineSpeeds
from cmx.simulate.cluster import DRAM, NVME, ClusterSpec
from cmx.simulate.config import SimConfig
from cmx.simulate.engine import Simulator
from cmx.simulate.hardware import LLAMA3_8B, GpuSpec, NetworkSpec, NodeSpec, TierSpec
from cmx.simulate.strategy import CMX
from cmx.simulate.workload import TenantSpec, WorkloadSpec

__all__ = ["cpu_floor", "cpu_seconds", "predict_load", "predict_loads"]

UNBOUNDED = 1e18  # bytes/s of a link whose move is counted as CPU work instead


def cpu_seconds(speeds: MachineSpeeds, source: str, nbytes: int, threads: int = 1) -> float:
    """One thread's seconds of CPU work in a load of ``nbytes`` from ``source``, with
    ``threads`` threads at work at once: the client's copy into its tensor, each block
    checked as it is copied (``cmx.client.copy_out``); for NVMe and peer reads, the agent's
    checksum of every block as it lands. A DRAM block is read where it lies, in the tier's
    shared-memory arena: no copy between arenas."""
    checksums = 0 if source == "dram" else 1
    return nbytes / speeds.copy_out_at(threads) + checksums * nbytes / speeds.checksum


def predict_loads(speeds: MachineSpeeds, control: ControlCosts, source: str, blocks: int,
                  block_bytes: int, clients: int = 1, cores: int = 1) -> list[float]:
    """Seconds each of ``clients`` loads of ``blocks`` blocks from ``source`` takes, all
    submitted at once on node a: its control cost per load and per block, its links, then
    its CPU work on the node's ``cores`` (the clients' processes on as many threads as there
    are cores: each client is a thread of its own, in the caller's process or another)."""
    big = 1 << 50
    threads = min(cores, clients)
    node = NodeSpec(gpu=GpuSpec("host", big, UNBOUNDED, 1e12), gpus=1,
                    dram=TierSpec(big, UNBOUNDED, 0.0),
                    nvme=TierSpec(big, speeds.odirect_read, 0.0),
                    dram_bus_bandwidth=UNBOUNDED, nvme_write_bandwidth=speeds.odirect_read,
                    host_cores=cores, process_threads=cores)
    tokens = block_bytes // LLAMA3_8B.kv_bytes_per_token
    # The control path is a wait on round trips, not this node's CPU: a latency per load
    # and one per block (an I/O a block).
    strategy = CMX.with_(control_s=control.fixed_s, per_io_wait_s=control.per_block_s,
                         per_io_cpu_s=0.0, io_bytes=block_bytes, io_depth=16,
                         verify_bandwidth=speeds.checksum, consumer_verifies=False,
                         copy_out_bandwidth=speeds.copy_out_at(threads))
    workload = WorkloadSpec((TenantSpec("calibration", context_tokens=(tokens, tokens)),),
                            rate_per_s=1e-3, duration_s=1.0)
    config = SimConfig(workload, ClusterSpec(2, node, NetworkSpec(speeds.nixl, 0.0), 0),
                       LLAMA3_8B, strategy, unit_tokens=tokens)
    sim = Simulator(config)
    here, there = sim.cluster.nodes
    holder, tier = {"dram": (here, DRAM), "nvme": (here, NVME), "dram@peer": (there, DRAM)}[source]
    ended = [math.nan] * clients
    jobs = []
    for c in range(clients):
        keys = [b"calibration-%d-%d" % (c, i) for i in range(blocks)]
        for key in keys:
            sim.cluster.add_copy(key, holder, tier, block_bytes)
        job = sim.mover.load_job(here.replicas[0], [holder.index * 4 + tier] * blocks, keys,
                                 Priority.LOAD)
        job.waiters.append(functools.partial(ended.__setitem__, c))
        jobs.append(job)
    for job in jobs:
        sim.mover.submit(here.agent, job)
    sim.run_jobs(jobs)
    return ended


def predict_load(speeds: MachineSpeeds, control: ControlCosts, source: str, blocks: int,
                 block_bytes: int) -> float:
    """Seconds the simulator gives one load of ``blocks`` blocks from ``source``, alone."""
    return predict_loads(speeds, control, source, blocks, block_bytes)[0]


def cpu_floor(loads: int, cpu_per_load_s: float | None, cores: int) -> float | None:
    """Seconds ``cores`` take to supply ``loads`` times ``cpu_per_load_s`` (one load's own
    CPU-seconds, measured alone): no load of ``loads`` started together can end sooner. None
    where that CPU was not measured."""
    if cores < 1:
        raise ValueError(f"cores {cores} < 1")
    if cpu_per_load_s is None:
        return None
    return loads * cpu_per_load_s / cores
