"""``cmx simulate --calibrate``: does the simulator predict the service on this machine?

1. This machine's tier speeds, measured without the service at the start of each repetition
   (the machine is shared; its speeds drift): the client's checked copy of blocks into a new
   tensor (``cmx.client.copy_out.copy_payloads``, on a thread; and each thread's speed with a
   thread on every core), O_DIRECT reads of a file in the NVMe directory (4 MiB, 8 in
   flight), XXH3 checksums, the agent's copy between arenas (``cmx.buffers.copy_bytes``,
   NIXL's stand-in), and NIXL (UCX) between two processes (``calibrate_nixl``).
2. The service's own load times through the public client API (``ContextMemory`` and
   ``NamespaceClient.load``) on an embedded two-node Ray cluster (``calibrate_service``):
   prefixes in this node's DRAM, in this node's NVMe and in the other node's DRAM, loaded by
   1, 4 and 16 clients at once (``clients``), each its own prefix; and prefixes of one and of
   eight tiny blocks, loaded alone, which measure the control path (a fixed cost per load and
   one per block).
3. The simulator, given only (1) and the control costs of the tiny loads of the same
   repetition, predicts the same N loads (``calibrate_predict``): N load jobs through the
   ``Mover``, agent lanes and links of a two-node cluster with the measured speeds, then their
   CPU work on ``min(cores, N)`` threads; for N > 1, no load ends before the cores could
   supply N times one load's own CPU-seconds (measured in step 2 with one client: the
   machine's busy CPU-seconds over the load, less what it keeps busy with no load running;
   its copy out at the speed of ``min(cores, N)`` threads copying at once). Each cell
   (source, N) compares the median of every load measured with the median of every load
   predicted; the goal: within 25%.
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
    copy_out: float  # the client's checked copy of blocks into a new tensor, on a thread
    odirect_read: float  # O_DIRECT, 4 MiB reads, 8 in flight, page cache bypassed
    checksum: float  # XXH3-64 over a buffer
    nixl: float  # NIXL UCX reads between two processes; ``copy`` where NIXL cannot run
    nixl_note: str  # how ``nixl`` was measured
    # ``copy_out`` of each thread while every core runs one (they share the memory's
    # bandwidth and the kernel's page faults); ``copy_out`` where not measured
    copy_out_shared: float | None = None

    def copy_out_at(self, threads: int) -> float:
        """The copy out's speed per thread with ``threads`` copying at once."""
        return self.copy_out if threads < 2 or not self.copy_out_shared else self.copy_out_shared


@dataclass(frozen=True)
class ControlCosts:
    """The control path of one load from one kind of source: ``fixed + per_block * n``."""

    fixed_s: float
    per_block_s: float


@dataclass(frozen=True)
class Row:
    """One cell: ``clients`` loads at once from ``source``, measured and predicted.

    Both sides are medians over every load of every repetition: each repetition's loads
    against the simulator's durations of the same loads from that repetition's own speeds and
    control costs. The machine is shared; its neighbours slow both sides, and a median keeps
    them in the comparison rather than choosing a machine state that never existed."""

    source: str
    clients: int
    blocks: int  # per load
    nbytes: int  # per load
    measured_s: tuple[float, ...]  # the service: every load's wall time
    predicted_s: tuple[float, ...]  # the simulator: every load's duration

    @property
    def measured(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def predicted(self) -> float:
        return statistics.median(self.predicted_s)

    @property
    def error(self) -> float:
        """Signed: the prediction's median over the measured median, less one."""
        return self.predicted / self.measured - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= GOAL


@dataclass(frozen=True)
class CalibrationResult:
    speeds: MachineSpeeds  # the median of each speed over the repetitions
    control: dict[str, ControlCosts]  # the median of each cost over the repetitions
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    raw: dict[str, Any] = field(default_factory=dict)  # every measurement, for the JSON

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def goal(self) -> float:
        """The largest relative error a row is allowed (``Row.ok``)."""
        return GOAL

    @property
    def command(self) -> str:
        """The command that measures it again and writes its section of the docs."""
        return COMMAND

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title="cmx simulate --calibrate: the service's loads, measured and predicted")
        for col in ("source", "clients", "bytes/load", "loads", "measured s (median)",
                    "predicted s (median)", "error", "goal"):
            t.add_column(col, justify="left" if col == "source" else "right")
        for r in self.rows:
            t.add_row(r.source, str(r.clients), f"{r.nbytes / MiB:.0f} MiB",
                      str(len(r.measured_s)), f"{r.measured:.3f}", f"{r.predicted:.3f}",
                      f"{100 * r.error:+.1f}%", "PASS" if r.ok else "MISS")
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"speeds": asdict(self.speeds),
                "control": {k: asdict(v) for k, v in self.control.items()},
                "rows": [{**asdict(r), "measured_median_s": r.measured,
                          "predicted_median_s": r.predicted, "error": r.error, "ok": r.ok}
                         for r in self.rows],
                "ok": self.ok, "goal": self.goal, "notes": list(self.notes),
                "command": self.command, "raw": self.raw}


# -- 1. this machine -----------------------------------------------------------------------------


def _median_rate(nbytes: int, fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm: page faults, thread pools, caches of code
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _copy_out_rate(block_bytes: int, blocks: int, threads: int = 1) -> float:
    """The client's copy out (``cmx.client.copy_out.copy_payloads``: each block copied into
    its place in a new tensor, checked as it is copied), on a thread of its own, as every
    load of the calibration runs. The tensor is new each time, as a load makes it: its pages
    fault in as the blocks land, and that is part of the cost (a thread's large allocation
    gets fresh pages; the calling thread's can reuse the heap's, and then runs at several
    times the speed: a load's speed that depends on what ran before it in the process).
    With ``threads`` > 1, that many copy at once, each its own tensor: each one's speed."""
    from cmx.checksum import checksum
    from cmx.client.copy_out import copy_payloads, empty_kv
    from cmx.keys import BlockHash
    from cmx.simulate.hardware import LLAMA3_8B

    layout = LLAMA3_8B.layout(block_bytes // LLAMA3_8B.kv_bytes_per_token)
    payload = np.random.default_rng(0).integers(0, 256, layout.block_bytes, dtype=np.uint8)
    payloads = [(BlockHash(b"calibration"), payload, int(checksum(payload)))] * blocks

    def copy_out() -> None:
        out = empty_kv(layout, blocks * layout.block_tokens)
        if copy_payloads(layout, payloads, out, 0) != blocks:
            raise AssertionError("a block failed its checksum in the copy-out measurement")

    def together() -> None:
        for done in [pool.submit(copy_out) for _ in range(threads)]:
            done.result()

    with ThreadPoolExecutor(threads) as pool:  # threads reused: as a load's client threads
        return _median_rate(blocks * layout.block_bytes, together)


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
    cores = os.cpu_count() or 1
    threads = min(cores, 16)  # bounded memory: each thread its own tensor
    shared = _copy_out_rate(block_bytes, max(2, nbytes // block_bytes // threads),
                            threads) if cores > 1 else None
    odirect = _odirect_read_rate(directory, nbytes)
    rate, note = nixl or nixl_read_rate(nbytes)
    if rate is None:
        rate = copy
    return MachineSpeeds(copy, copy_out, odirect, checksum, rate, note, shared)


def _describe(s: MachineSpeeds) -> str:
    return (f"copy {s.copy / GB:.2f}, copy-out {s.copy_out / GB:.2f} "
            f"({s.copy_out_at(2) / GB:.2f} a thread on every core), O_DIRECT read "
            f"{s.odirect_read / GB:.2f}, XXH3 {s.checksum / GB:.2f}, NIXL {s.nixl / GB:.2f} GB/s")


# -- 3. the prediction (``calibrate_predict``) -------------------------------------------------


def predict_load(speeds: MachineSpeeds, control: ControlCosts, source: str, blocks: int,
                 block_bytes: int) -> float:
    """Seconds the simulator gives one load of ``blocks`` blocks from ``source``, alone."""
    from cmx.simulate.calibrate_predict import predict_loads

    return predict_loads(speeds, control, source, blocks, block_bytes)[0]


def _control(tiny: dict[int, list[float]], rep: int, slot_s: float = 0.0) -> ControlCosts:
    """Fixed and per-block control costs from the tiny loads of repetition ``rep``.

    ``slot_s``: seconds the service spends moving each tiny block's bytes beyond the block
    itself. A peer pull moves whole slots (the transport's descriptors are per slot piece),
    so a 4 KiB block costs a slot's transfer; that is bandwidth, not control.
    """
    one, eight = tiny[1][rep], tiny[8][rep]
    per_block = max(0.0, (eight - one) / 7 - slot_s)
    return ControlCosts(max(0.0, one - per_block - slot_s), per_block)


def _median_speeds(all_speeds: list[MachineSpeeds]) -> MachineSpeeds:
    """The median of each speed measured in the run, for the record (each repetition's
    prediction uses its own)."""
    def mid(name: str) -> float:
        return float(statistics.median(getattr(s, name) for s in all_speeds))

    shared = [s.copy_out_shared for s in all_speeds if s.copy_out_shared]
    return MachineSpeeds(mid("copy"), mid("copy_out"), mid("odirect_read"), mid("checksum"),
                         mid("nixl"), all_speeds[0].nixl_note,
                         float(statistics.median(shared)) if shared else None)


def _in_round_trips(control: dict[str, ControlCosts], round_trips: list[float]) -> list[str]:
    if not round_trips:
        return []
    rtt = float(np.median(round_trips))
    fixed = ", ".join(f"{k} {v.fixed_s / rtt:.0f}" for k, v in control.items())
    return [f"a bare Ray actor round trip: {rtt * 1e3:.2f} ms (median of {len(round_trips)}); "
            f"each load's fixed control cost in round trips: {fixed}"]


def _slot_s(source: str, speeds: MachineSpeeds) -> float:
    """Seconds a tiny peer block's whole slot takes over the link (see ``_control``)."""
    from cmx.simulate.calibrate_service import BLOCK_BYTES

    return BLOCK_BYTES / speeds.nixl if source.endswith("@peer") else 0.0


def _own_cpu(loads: Any, source: str, rep: int, nbytes: int, threads: int) -> float | None:
    """One load's own CPU-seconds, measured alone in repetition ``rep``, with its copy out at
    the speed of ``threads`` threads copying at once."""
    from cmx.simulate.calibrate_predict import cpu_seconds

    alone = loads.load_cpu_alone(source, rep)
    if alone is None:
        return None
    speeds = loads.baselines[source][rep]
    return alone + (cpu_seconds(speeds, source, nbytes, threads)
                    - cpu_seconds(speeds, source, nbytes, 1))


def run_calibration(log: Callable[[str], None] = print, reps: int = 3, blocks: int = 6,
                    clients: tuple[int, ...] = (1, 4, 16), sources: tuple[str, ...] = SOURCES,
                    directory: Path = Path("/var/tmp"),
                    measure_bytes: int = 256 * MiB) -> CalibrationResult:
    """Each repetition measures this machine's speeds right before the service's loads (the
    machine is shared and its speeds drift), then the tiny loads, then for each number of
    clients that many loads at once, each of its own prefix; each repetition's predictions
    use its own figures. Every cell compares medians."""
    from cmx.simulate.calibrate_nixl import nixl_read_rate
    from cmx.simulate.calibrate_predict import machine_bound, predict_loads
    from cmx.simulate.calibrate_service import BLOCK_BYTES, measure_service

    cores = os.cpu_count() or 1
    log(f"calibration: {', '.join(sources)} with {', '.join(map(str, clients))} clients, "
        f"{reps} repetitions, on {cores} cores")

    def baseline() -> MachineSpeeds:
        speeds = measure_machine(directory, nbytes=measure_bytes, block_bytes=BLOCK_BYTES,
                                 nixl=nixl_read_rate(measure_bytes))
        log(_describe(speeds))
        return speeds

    loads = measure_service(directory, reps=reps, blocks=blocks, clients=clients,
                            sources=sources, log=log, baseline=baseline)
    rows, control, bound = [], {}, []
    for s in sources:
        costs = [_control(loads.tiny[s], rep, _slot_s(s, loads.baselines[s][rep]))
                 for rep in range(reps)]
        control[s] = ControlCosts(statistics.median(c.fixed_s for c in costs),
                                  statistics.median(c.per_block_s for c in costs))
        for n in clients:
            simulated = [predict_loads(loads.baselines[s][rep], costs[rep], s, blocks,
                                       BLOCK_BYTES, n, cores) for rep in range(reps)]
            # One client's own cell is predicted without its CPU.
            predicted = [t for rep in range(reps)
                         for t in machine_bound(
                             simulated[rep],
                             _own_cpu(loads, s, rep, blocks * BLOCK_BYTES, min(cores, n))
                             if n > 1 else None, cores)]
            raised = sum(p > t for p, t in zip(predicted, (t for v in simulated for t in v)))
            bound.append(f"{s} {n} clients {raised} of {len(predicted)}")
            measured = [t for each in loads.large[s][n] for t in each]
            rows.append(Row(s, n, blocks, blocks * BLOCK_BYTES, tuple(measured),
                            tuple(predicted)))
    speeds = _median_speeds([b for v in loads.baselines.values() for b in v])
    own = {src: [c for rep in range(reps) if (c := loads.load_cpu_alone(src, rep)) is not None]
           for src in sources}
    own = {src: v for src, v in own.items() if v}
    cpu = "; ".join(f"{src} " + ", ".join(f"{n} clients {statistics.median(v):.3f}"
                                          for n, v in sorted(per.items()))
                    for src, per in loads.cpu.items())
    notes = (f"load average {os.getloadavg()[0]:.1f} at the end, on {cores} cores",
             *loads.notes, *_in_round_trips(control, loads.round_trip_s),
             f"the machine's busy CPU-seconds per load (median over repetitions): {cpu}",
             "its busy cores with no load running: " + ", ".join(
                 f"{src} {statistics.median(v):.2f}" for src, v in loads.idle.items()),
             "one load's own CPU-seconds alone (less those): " + ", ".join(
                 f"{src} {statistics.median(own[src]):.3f}" for src in own),
             "predictions the CPU bound set, not the simulated links and lanes: "
             + ", ".join(bound))
    raw = {"tiny_s": loads.tiny, "large_s": loads.large, "cpu_per_load_s": loads.cpu,
           "idle_busy_cores": loads.idle, "load_cpu_alone_s": own,
           "speeds": {k: [asdict(b) for b in v] for k, v in loads.baselines.items()}}
    return CalibrationResult(speeds, control, tuple(rows), notes, raw)


def write_calibration(result: CalibrationResult, json_path: Path, docs: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    if docs is not None:
        from cmx.simulate.calibrate_docs import rewrite_section

        rewrite_section(docs, result)
