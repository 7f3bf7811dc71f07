"""``cmx simulate --calibrate``: does the simulator predict the service on this machine?

1. This machine's tier speeds, measured without the service, in each repetition right
   before the service's loads (the machine is shared; its speeds drift): the agent's copy between
   arenas (``cmx.buffers.copy_bytes``), the client's copy of a block into its output tensor,
   O_DIRECT reads of a file in the NVMe directory (4 MiB, 8 in flight), XXH3 checksums, and
   NIXL (UCX) between two processes (``calibrate_nixl``).
2. The service's own load times through the public client API (``ContextMemory`` and
   ``NamespaceClient.load``) on an embedded two-node Ray cluster (``calibrate_service``): a
   prefix in this node's DRAM, in this node's NVMe, and in the other node's DRAM; and the
   same for prefixes of one and of eight tiny blocks, which measure the control path alone
   (a fixed cost per load and one per block).
3. The simulator, given only (1) and the control costs of the tiny loads, predicts the large
   loads: a two-node cluster whose tiers have the measured speeds runs one load job through
   the same ``Mover`` and links as every simulation. The goal: within 25% of the service.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cmx.simulate.hardware import GpuSpec, NetworkSpec, NodeSpec, TierSpec

__all__ = ["CalibrationResult", "MachineSpeeds", "measure_machine", "predict_load",
           "run_calibration", "write_calibration"]

MiB = 1 << 20
GB = 1e9
GOAL = 0.25  # the largest relative error of a prediction
COMMAND = "cmx simulate --calibrate --docs docs/BENCHMARKS.md"
SOURCES = ("dram", "nvme", "dram@peer")


@dataclass(frozen=True)
class MachineSpeeds:
    """Bytes/s of this machine's moves, each the median of a few runs."""

    copy: float  # copy_bytes between two faulted-in buffers: the agent's arena-to-arena copy
    copy_out: float  # a block's payload into its slice of the client's output tensor
    odirect_read: float  # O_DIRECT, 4 MiB reads, 8 in flight, page cache bypassed
    checksum: float  # XXH3-64 over a buffer
    nixl: float  # NIXL UCX reads between two processes; ``copy`` where NIXL cannot run
    nixl_note: str  # how ``nixl`` was measured


@dataclass(frozen=True)
class ControlCosts:
    """The control path of one load from one kind of source: ``fixed + per_block * n``."""

    fixed_s: float
    per_block_s: float


@dataclass(frozen=True)
class Row:
    """One source's loads against the prediction.

    Both sides are the least contended of the run: the fastest load, against the prediction
    from the fastest of each speed and control cost. The machine is shared; other work only
    ever adds time, and by different amounts to a microbenchmark and to a load a second
    apart, so medians compare two samples of the neighbours' load, not the model."""

    source: str
    blocks: int
    nbytes: int
    measured_s: tuple[float, ...]  # the service, one per repetition
    predicted_s: float  # the simulator, from the run's least contended figures
    predicted_each_s: tuple[float, ...]  # the simulator, from each repetition's own figures

    @property
    def measured(self) -> float:
        return min(self.measured_s)

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured - 1.0


@dataclass(frozen=True)
class CalibrationResult:
    speeds: MachineSpeeds
    control: dict[str, ControlCosts]
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    raw: dict[str, Any] = field(default_factory=dict)  # every measurement, for the JSON

    @property
    def ok(self) -> bool:
        return all(abs(r.error) <= GOAL for r in self.rows)

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title="cmx simulate --calibrate: the service's loads, measured and predicted")
        for col in ("source", "bytes", "measured s (fastest)", "predicted s", "error", "goal"):
            t.add_column(col, justify="left" if col == "source" else "right")
        for r in self.rows:
            t.add_row(r.source, f"{r.nbytes / MiB:.0f} MiB", f"{r.measured:.3f}",
                      f"{r.predicted_s:.3f}", f"{100 * r.error:+.1f}%",
                      "PASS" if abs(r.error) <= GOAL else "MISS")
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"speeds": asdict(self.speeds),
                "control": {k: asdict(v) for k, v in self.control.items()},
                "rows": [{**asdict(r), "measured_median_s": r.measured,
                          "predicted_median_s": r.predicted_s, "error": r.error}
                         for r in self.rows],
                "ok": self.ok, "goal": GOAL, "notes": list(self.notes), "command": COMMAND,
                "raw": self.raw}


# -- 1. this machine -----------------------------------------------------------------------------


def _median_rate(nbytes: int, fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm: page faults, thread pools, caches of code
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _copy_out_rate(block_bytes: int, blocks: int) -> float:
    import torch

    from cmx.simulate.hardware import LLAMA3_8B

    layout = LLAMA3_8B.layout(block_bytes // LLAMA3_8B.kv_bytes_per_token)
    payload = np.random.default_rng(0).integers(0, 256, layout.block_bytes, dtype=np.uint8)
    T = layout.block_tokens

    def run() -> None:
        # A new tensor each time, as the client makes for each load: its pages fault in
        # as the blocks land, and that is part of the cost.
        out = torch.empty(layout.shape(blocks * T), dtype=layout.torch_dtype())
        for i in range(blocks):
            out[:, :, :, i * T:(i + 1) * T].copy_(layout.from_payload(payload))

    return _median_rate(blocks * layout.block_bytes, run)


def _odirect_read_rate(directory: Path, nbytes: int, io: int = 4 * MiB, depth: int = 8) -> float:
    from cmx.buffers import aligned_empty

    path = Path(tempfile.mkdtemp(prefix="cmx-calibrate-", dir=directory)) / "data"
    buf = aligned_empty(nbytes)
    buf[:] = 7
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        for off in range(0, nbytes, io):
            os.pwritev(fd, [buf[off:off + io].data], off)
        os.fsync(fd)
        with ThreadPoolExecutor(depth) as pool:
            def run() -> None:
                list(pool.map(lambda off: os.preadv(fd, [buf[off:off + io].data], off),
                              range(0, nbytes, io)))
            return _median_rate(nbytes, run)
    finally:
        os.close(fd)
        path.unlink()
        path.parent.rmdir()


def _memory_rates(nbytes: int) -> tuple[float, float]:
    """(copy_bytes, XXH3) bytes/s over ``nbytes`` of faulted-in memory."""
    import xxhash

    from cmx.buffers import aligned_empty, copy_bytes

    src, dst = aligned_empty(nbytes), aligned_empty(nbytes)
    src[:] = 1
    dst[:] = 0
    copy = _median_rate(nbytes, lambda: copy_bytes(dst, src))
    checksum = _median_rate(nbytes, lambda: xxhash.xxh3_64_intdigest(src.data))
    return copy, checksum


def measure_machine(directory: Path, nbytes: int = 256 * MiB, block_bytes: int = 16 * MiB,
                    nixl: tuple[float | None, str] | None = None) -> MachineSpeeds:
    """This machine's speeds now; ``nixl`` as measured before (it takes a process)."""
    from cmx.simulate.calibrate_nixl import nixl_read_rate

    copy, checksum = _memory_rates(nbytes)
    copy_out = _copy_out_rate(block_bytes, nbytes // block_bytes)
    odirect = _odirect_read_rate(directory, nbytes)
    rate, note = nixl or nixl_read_rate(nbytes)
    if rate is None:
        rate = copy
    return MachineSpeeds(copy, copy_out, odirect, checksum, rate, note)


def _describe(s: MachineSpeeds) -> str:
    return (f"copy {s.copy / GB:.2f}, copy-out {s.copy_out / GB:.2f}, O_DIRECT read "
            f"{s.odirect_read / GB:.2f}, XXH3 {s.checksum / GB:.2f}, NIXL {s.nixl / GB:.2f} GB/s")


# -- 3. the prediction ---------------------------------------------------------------------------


def predict_load(speeds: MachineSpeeds, control: ControlCosts, source: str, blocks: int,
                 block_bytes: int) -> float:
    """Seconds the simulator gives one load of ``blocks`` blocks from ``source``.

    The cluster: two nodes of one replica each; every link at the measured speed; the
    strategy's control cost per load and per block (one I/O per block) from the tiny loads;
    the agent's checksums of NVMe and peer reads, the client's checksum of every block and its
    copy into the client's tensor, as the service does them on a host without a GPU.
    """
    from cmx.simulate.cluster import DRAM, NVME, ClusterSpec
    from cmx.simulate.engine import SimConfig, Simulator
    from cmx.simulate.hardware import LLAMA3_8B
    from cmx.simulate.strategy import CMX
    from cmx.simulate.workload import TenantSpec, WorkloadSpec

    big = 1 << 50
    node = NodeSpec(gpu=GpuSpec("host", big, speeds.copy, 1e12), gpus=1,
                    dram=TierSpec(big, speeds.copy, 0.0), nvme=TierSpec(big, speeds.odirect_read,
                                                                        0.0),
                    dram_bus_bandwidth=speeds.copy, nvme_write_bandwidth=speeds.odirect_read)
    tokens = block_bytes // LLAMA3_8B.kv_bytes_per_token
    strategy = CMX.with_(control_s=control.fixed_s, per_io_cpu_s=control.per_block_s,
                         io_bytes=block_bytes, io_depth=16, lanes=1,
                         verify_bandwidth=speeds.checksum, consumer_verifies=True,
                         copy_out_bandwidth=speeds.copy_out)
    workload = WorkloadSpec((TenantSpec("calibration", context_tokens=(tokens, tokens)),),
                            rate_per_s=1e-3, duration_s=1.0)
    config = SimConfig(workload, ClusterSpec(2, node, NetworkSpec(speeds.nixl, 0.0), 0),
                       LLAMA3_8B, strategy, unit_tokens=tokens)
    sim = Simulator(config)
    here, there = sim.cluster.nodes
    holder, tier = {"dram": (here, DRAM), "nvme": (here, NVME), "dram@peer": (there, DRAM)}[source]
    keys = [b"calibration-%d" % i for i in range(blocks)]
    for key in keys:
        sim.cluster.add_copy(key, holder, tier, block_bytes)
    return sim.time_load(here.replicas[0], [holder.index * 4 + tier] * blocks, keys)


def _control(tiny: dict[int, list[float]], rep: int, slot_s: float = 0.0) -> ControlCosts:
    """Fixed and per-block control costs from the tiny loads of repetition ``rep``.

    ``slot_s``: seconds the service spends moving each tiny block's bytes beyond the block
    itself. A peer pull moves whole slots (the transport's descriptors are per slot piece),
    so a 4 KiB block costs a slot's transfer; that is bandwidth, not control.
    """
    one, eight = tiny[1][rep], tiny[8][rep]
    per_block = max(0.0, (eight - one) / 7 - slot_s)
    return ControlCosts(max(0.0, one - per_block - slot_s), per_block)


def _best_speeds(all_speeds: list[MachineSpeeds]) -> MachineSpeeds:
    """The fastest of each speed measured in the run: the machine at its least contended."""
    def best(name: str) -> float:
        return float(max(getattr(s, name) for s in all_speeds))

    return MachineSpeeds(best("copy"), best("copy_out"), best("odirect_read"), best("checksum"),
                         best("nixl"), all_speeds[0].nixl_note)


def _in_round_trips(control: dict[str, ControlCosts], round_trips: list[float]) -> list[str]:
    if not round_trips:
        return []
    rtt = float(np.percentile(round_trips, 10))  # the uncontended hop, as the costs are
    fixed = ", ".join(f"{k} {v.fixed_s / rtt:.0f}" for k, v in control.items())
    return [f"a bare Ray actor round trip: {rtt * 1e3:.2f} ms (10th percentile of "
            f"{len(round_trips)}, median {float(np.median(round_trips)) * 1e3:.2f} ms); "
            f"each load's fixed control cost in round trips: {fixed}"]


def _slot_s(source: str, speeds: MachineSpeeds) -> float:
    """Seconds a tiny peer block's whole slot takes over the link (see ``_control``)."""
    from cmx.simulate.calibrate_service import BLOCK_BYTES

    return BLOCK_BYTES / speeds.nixl if source.endswith("@peer") else 0.0


def run_calibration(log: Callable[[str], None] = print, reps: int = 5, blocks: int = 16,
                    directory: Path = Path("/var/tmp")) -> CalibrationResult:
    """Each repetition measures this machine's speeds right before the service's loads (the
    machine is shared and its speeds drift), and the tiny loads right before the large ones;
    each repetition's prediction uses its own figures."""
    from cmx.simulate.calibrate_nixl import nixl_read_rate
    from cmx.simulate.calibrate_service import BLOCK_BYTES, measure_service

    log("calibration: this machine's speeds are measured before each repetition's loads")

    def baseline() -> MachineSpeeds:
        speeds = measure_machine(directory, block_bytes=BLOCK_BYTES, nixl=nixl_read_rate(
            256 * MiB))
        log(_describe(speeds))
        return speeds

    loads = measure_service(directory, reps=reps, blocks=blocks, log=log, baseline=baseline)
    speeds = _best_speeds([b for v in loads.baselines.values() for b in v])
    rows, control = [], {}
    for s in SOURCES:
        predicted = []
        for rep in range(reps):
            each = loads.baselines[s][rep]
            costs = _control(loads.tiny[s], rep, _slot_s(s, each))
            predicted.append(predict_load(each, costs, s, blocks, BLOCK_BYTES))
        control[s] = _control({n: [min(v)] for n, v in loads.tiny[s].items()}, 0,
                              _slot_s(s, speeds))
        rows.append(Row(s, blocks, blocks * BLOCK_BYTES, tuple(loads.large[s]),
                        predict_load(speeds, control[s], s, blocks, BLOCK_BYTES),
                        tuple(predicted)))
    notes = (f"load average {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores",
             *loads.notes, *_in_round_trips(control, loads.round_trip_s))
    raw = {"tiny_s": loads.tiny, "large_s": loads.large,
           "speeds": {k: [asdict(b) for b in v] for k, v in loads.baselines.items()}}
    return CalibrationResult(speeds, control, tuple(rows), notes, raw)


def write_calibration(result: CalibrationResult, json_path: Path, docs: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    if docs is not None:
        from cmx.simulate.calibrate_docs import rewrite_section

        rewrite_section(docs, result)
