"""The cluster scenarios' parameters against this machine.

The scenarios of ``cmx simulate`` run on the hardware of ``hardware.NodeSpec()`` and
``NetworkSpec()`` and the strategies of ``strategy``; the calibration measures, in the same
run, what of that can be measured on this machine, and says for the rest why it cannot
(``NOT_HERE``). Each scenario value is read from those objects, never copied; its kind (seed
or assumed) is the one docs/SIMULATE.md's table of inputs gives it.

What is measured: the control cost of a load and of a block (the tiny loads, ``run._control``),
the agent's CPU per 2 MiB moved (``agent_cpu_per_io``), O_DIRECT reads of the NVMe directory
(bandwidth and one read's latency), NIXL between two processes, and the memory copy
(``machine``). Each is the median over the run's repetitions, with the least and the most.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from cmx.simulate.calibrate.predict import cpu_seconds
from cmx.simulate.calibrate.result import (
    ControlCosts,
    Kind,
    MachineSpeeds,
    Parameter,
    Spread,
    Unit,
)
from cmx.simulate.hardware import H100, NetworkSpec, NodeSpec
from cmx.simulate.strategy import CMX, LMCACHE_GDS_LIKE, LMCACHE_LIKE

__all__ = ["NOT_HERE", "agent_cpu_per_io", "scenario_parameters"]

WHERE = {"dram": "this node's DRAM", "nvme": "this node's NVMe",
         "dram@peer": "the other node's DRAM"}
_NODE, _NET = NodeSpec(), NetworkSpec()
NO_GPU = "no GPU here"

# The parameters that need a GPU or a NIC this machine does not have: never given a value.
NOT_HERE: tuple[Parameter, ...] = (
    Parameter("HBM bandwidth", Unit.GBS, H100.hbm_bandwidth, Kind.SEED,
              "hardware.H100.hbm_bandwidth", None, f"{NO_GPU}: no HBM to read"),
    Parameter("DRAM -> HBM, one GPU's link", Unit.GBS, _NODE.dram.bandwidth, Kind.SEED,
              "hardware.NodeSpec().dram.bandwidth", None,
              f"{NO_GPU}: no PCIe link into HBM; a DRAM load here ends in a host copy into a "
              "new tensor (the copy out, among the speeds above), a different move"),
    Parameter("DRAM -> HBM latency, per I/O", Unit.US, _NODE.dram.latency_s, Kind.ASSUMED,
              "hardware.NodeSpec().dram.latency_s", None,
              f"{NO_GPU}: no transfer into HBM to time (the seed gives 10-100 µs)"),
    Parameter("network: the NIC, per node and direction", Unit.GBS, _NET.bandwidth,
              Kind.ASSUMED, "hardware.NetworkSpec().bandwidth", None,
              "no NIC between the embedded cluster's two nodes: they are processes of this "
              "machine (NIXL between them is the row below)"),
    Parameter("network: one hop's latency", Unit.US, _NET.latency_s, Kind.ASSUMED,
              "hardware.NetworkSpec().latency_s", None,
              "no NIC and no RDMA here: a round trip between two processes of one machine "
              "times shared memory and the kernel, not a hop"),
    Parameter("LMCache-like: serving-process CPU per 256-token chunk", Unit.MS,
              LMCACHE_LIKE.per_io_cpu_s, Kind.ASSUMED, "strategy.LMCACHE_LIKE.per_io_cpu_s",
              None, f"{NO_GPU}: the CPU of LMCache's connector inside a vLLM serving process, "
              "moving chunks to and from the GPU's paged KV; no such process runs here"),
    Parameter("LMCache-like: control per load", Unit.MS, LMCACHE_LIKE.control_s, Kind.ASSUMED,
              "strategy.LMCACHE_LIKE.control_s", None,
              f"{NO_GPU}: as the CPU per chunk, a cost inside a vLLM serving process"),
    Parameter("LMCache-GDS-like: CPU per 64 KiB GPUDirect read", Unit.US,
              LMCACHE_GDS_LIKE.per_io_cpu_s, Kind.ASSUMED,
              "strategy.LMCACHE_GDS_LIKE.per_io_cpu_s", None,
              f"{NO_GPU}: GPUDirect Storage (cuFile) reads into GPU memory"),
)


def agent_cpu_per_io(own_cpu_s: float, speeds: MachineSpeeds, source: str, nbytes: int,
                     io_bytes: int = CMX.io_bytes) -> float:
    """CPU-seconds per ``io_bytes`` I/O of a load of ``nbytes`` from ``source`` beyond what
    the model charges separately: one load's own CPU-seconds, measured alone, less
    ``predict.cpu_seconds`` at that repetition's speeds (the copy out, ``nbytes / copy_out``;
    for NVMe and peer loads the agent's checksum, ``nbytes / checksum``), over the load's
    I/Os. Negative where those charges exceed what was measured."""
    ios = math.ceil(nbytes / io_bytes)
    return (own_cpu_s - cpu_seconds(speeds, source, nbytes, 1)) / ios


def _per_source(control: Mapping[str, Sequence[ControlCosts]],
                own_cpu: Mapping[str, Sequence[tuple[float | None, MachineSpeeds]]],
                nbytes: int) -> list[Parameter]:
    out = []
    for source, costs in control.items():
        out.append(Parameter(
            f"control per load, {source}", Unit.MS, CMX.control_s, Kind.ASSUMED,
            "strategy.CMX.control_s", Spread.of([c.fixed_s for c in costs]),
            f"loads of 1 and of 8 tiny blocks from {WHERE[source]} through the client: the "
            "fixed part of their time (run._control); a wait on round trips, not only CPU"))
    for source, costs in control.items():
        out.append(Parameter(
            f"control per block, {source}", Unit.US, CMX.per_io_cpu_s + CMX.per_io_wait_s,
            Kind.ASSUMED, "strategy.CMX.per_io_cpu_s + per_io_wait_s (a block: one I/O)",
            Spread.of([c.per_block_s for c in costs]),
            f"the same loads from {WHERE[source]}: their time per block beyond the first "
            "(run._control; a peer's less each tiny block's 16 MiB slot over NIXL)"))
    for source, reps in own_cpu.items():
        # A repetition whose CPU read as none (10 ms ticks, clamped at 0) or as less than the
        # copies the model charges measured nothing: it is left out, and counted.
        every = [agent_cpu_per_io(cpu, speeds, source, nbytes) for cpu, speeds in reps
                 if cpu is not None]
        per_io = [x for x in every if x > 0]
        unseen = (f"; {len(every) - len(per_io)} of {len(every)} repetitions left out: their "
                  "CPU, read in 10 ms ticks, came to no more than the copies"
                  if len(per_io) < len(every) else "")
        out.append(Parameter(
            f"agent CPU per 2 MiB moved, {source}", Unit.US, CMX.per_io_cpu_s, Kind.ASSUMED,
            "strategy.CMX.per_io_cpu_s", Spread.of(per_io) if per_io else None,
            f"one load of {nbytes >> 20} MiB from {WHERE[source]}, alone: the machine's busy "
            "CPU-seconds over it less its busy cores with no load running times the load's "
            "time (ServiceLoads.load_cpu_alone), less the copy out at the copy-out speed"
            + ("" if source == "dram" else " and the agent's checksum at the XXH3 speed")
            + f" (predict.cpu_seconds), over its {math.ceil(nbytes / CMX.io_bytes)} 2 MiB "
            "I/Os (agent_cpu_per_io). What remains holds the control path's CPU too (Ray "
            "calls, actor hops), so it bounds the agent's CPU per I/O from above; /proc/stat "
            "counts in 10 ms ticks" + unseen if per_io else "one load's CPU was not measured"
            + unseen))
    return out


def _machine(speeds: Sequence[MachineSpeeds], measure_bytes: int) -> list[Parameter]:
    latency = [s.odirect_latency_s for s in speeds if s.odirect_latency_s is not None]
    nixl = [s.nixl for s in speeds if s.nixl_measured]
    why_no_nixl = next((s.nixl_note for s in speeds if not s.nixl_measured), "")
    size = f"{measure_bytes >> 20} MiB"
    return [
        Parameter("NVMe read", Unit.GBS, _NODE.nvme.bandwidth, Kind.SEED,
                  "hardware.NodeSpec().nvme.bandwidth", Spread.of([s.odirect_read for s in speeds]),
                  f"O_DIRECT reads of a new {size} file in the NVMe directory, 4 MiB x 8 in "
                  "flight (machine._odirect_rates), whatever device holds that directory"),
        Parameter("NVMe latency, per I/O", Unit.US, _NODE.nvme.latency_s, Kind.ASSUMED,
                  "hardware.NodeSpec().nvme.latency_s", Spread.of(latency) if latency else None,
                  "the same file, one 4 KiB O_DIRECT read at a time at random offsets, median "
                  "of 64 (machine._odirect_latency); the scenarios' value lies within the "
                  "seed's 100 µs-1 ms" if latency else "not measured in this run"),
        Parameter("network: NIXL read between two processes", Unit.GBS, _NET.bandwidth,
                  Kind.ASSUMED, "hardware.NetworkSpec().bandwidth",
                  Spread.of(nixl) if nixl else None,
                  f"the service's transport (NixlTransport, UCX) reading {size} in 16 MiB "
                  "slots from another process of this machine (nixl.nixl_read_rate): shared "
                  "memory, not a NIC; the ceiling the software reaches here" if nixl
                  else f"NIXL could not run here: {why_no_nixl}"),
        Parameter("host memory copy", Unit.GBS, _NODE.dram_bus_bandwidth, Kind.ASSUMED,
                  "hardware.NodeSpec().dram_bus_bandwidth", Spread.of([s.copy for s in speeds]),
                  f"cmx.buffers.copy_bytes between two faulted-in {size} buffers on one thread "
                  "(the agent's arena-to-arena copy); the scenarios' value is the whole "
                  "memory bus, shared by every link, so one thread's copy is a lower bound"),
    ]


def scenario_parameters(control: Mapping[str, Sequence[ControlCosts]],
                        own_cpu: Mapping[str, Sequence[tuple[float | None, MachineSpeeds]]],
                        speeds: Sequence[MachineSpeeds], nbytes: int,
                        measure_bytes: int) -> tuple[Parameter, ...]:
    """Every parameter of the table: those measured in this run, then those that cannot be.

    ``control``: each source's control costs, per repetition; ``own_cpu``: each source's one
    load's own CPU-seconds (None where not measured) and the speeds of the same repetition;
    ``speeds``: every measurement of this machine in the run, each once; ``nbytes``: a
    load's bytes; ``measure_bytes``: the bytes each speed was measured over."""
    if not speeds:
        raise ValueError("no measurement of this machine's speeds")
    return (*_per_source(control, own_cpu, nbytes), *_machine(speeds, measure_bytes),
            *NOT_HERE)
