"""The calibration's run: each repetition measures this machine (``machine``), then the
service's loads (``service``), and the simulator predicts the same loads from that
repetition's own figures (``predict``); the rows compare medians (``result``), each beside
its CPU floor; the cluster scenarios' parameters are set against the same run's figures
(``parameters``); ``write_calibration`` writes the JSON and the section of
docs/BENCHMARKS.md (``docs``).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from cmx.bench.harness.machine import code_version
from cmx.simulate.calibrate.docs import rewrite_section
from cmx.simulate.calibrate.machine import describe, measure_machine
from cmx.simulate.calibrate.nixl import nixl_read_rate
from cmx.simulate.calibrate.parameters import scenario_parameters
from cmx.simulate.calibrate.predict import cpu_floor, cpu_seconds, predict_loads
from cmx.simulate.calibrate.result import CalibrationResult, ControlCosts, MachineSpeeds, MiB, Row
from cmx.simulate.calibrate.service import BLOCK_BYTES, measure_service

__all__ = ["SOURCES", "run_calibration", "write_calibration"]

SOURCES = ("dram", "nvme", "dram@peer")


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

    def mid_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v]
        return float(statistics.median(known)) if known else None

    return MachineSpeeds(mid("copy"), mid("copy_out"), mid("odirect_read"), mid("checksum"),
                         mid("nixl"), all_speeds[0].nixl_note,
                         mid_of([s.copy_out_shared for s in all_speeds]),
                         mid_of([s.odirect_latency_s for s in all_speeds]),
                         all(s.nixl_measured for s in all_speeds))


def _distinct(baselines: dict[str, list[MachineSpeeds]]) -> list[MachineSpeeds]:
    """Each measurement of the machine once: one serves every source of its cluster."""
    return list({id(b): b for per in baselines.values() for b in per}.values())


def _in_round_trips(control: dict[str, ControlCosts], round_trips: list[float]) -> list[str]:
    if not round_trips:
        return []
    rtt = float(np.median(round_trips))
    fixed = ", ".join(f"{k} {v.fixed_s / rtt:.0f}" for k, v in control.items())
    return [f"a bare Ray actor round trip: {rtt * 1e3:.2f} ms (median of {len(round_trips)}); "
            f"each load's fixed control cost in round trips: {fixed}"]


def _slot_s(source: str, speeds: MachineSpeeds) -> float:
    """Seconds a tiny peer block's whole slot takes over the link (see ``_control``)."""
    return BLOCK_BYTES / speeds.nixl if source.endswith("@peer") else 0.0


def _own_cpu(loads: Any, source: str, rep: int, nbytes: int, threads: int) -> float | None:
    """One load's own CPU-seconds, measured alone in repetition ``rep``, with its copy out at
    the speed of ``threads`` threads copying at once."""
    alone = loads.load_cpu_alone(source, rep)
    if alone is None:
        return None
    speeds = loads.baselines[source][rep]
    return alone + (cpu_seconds(speeds, source, nbytes, threads)
                    - cpu_seconds(speeds, source, nbytes, 1))


def _rows(loads: Any, source: str, costs: list[ControlCosts], blocks: int,
          clients: tuple[int, ...], cores: int) -> tuple[list[Row], list[str]]:
    """``source``'s rows, one for each number of clients, and for each how many predicted
    loads ended before their repetition's CPU floor. The simulator's predictions are the
    rows' predictions, as they come; the floor stands beside them, never in their place."""
    rows, below = [], []
    nbytes = blocks * BLOCK_BYTES
    for n in clients:
        simulated = [predict_loads(loads.baselines[source][rep], costs[rep], source, blocks,
                                   BLOCK_BYTES, n, cores) for rep in range(len(costs))]
        floors = [cpu_floor(n, _own_cpu(loads, source, rep, nbytes, min(cores, n)), cores)
                  for rep in range(len(costs))]
        under = sum(t < f for ts, f in zip(simulated, floors) if f is not None for t in ts)
        below.append(f"{source} {n} clients {under} of {sum(map(len, simulated))}")
        measured = [t for each in loads.large[source][n] for t in each]
        rows.append(Row(source, n, blocks, nbytes, tuple(measured),
                        tuple(t for ts in simulated for t in ts),
                        tuple(f for f in floors if f is not None)))
    return rows, below


def run_calibration(log: Callable[[str], None] = print, reps: int = 3, blocks: int = 6,
                    clients: tuple[int, ...] = (1, 4, 16), sources: tuple[str, ...] = SOURCES,
                    directory: Path = Path("/var/tmp"),
                    measure_bytes: int = 256 * MiB) -> CalibrationResult:
    """Each repetition measures this machine's speeds right before the service's loads (the
    machine is shared and its speeds drift), then the tiny loads, then for each number of
    clients that many loads at once, each of its own prefix; each repetition's predictions
    use its own figures. Every cell compares medians."""
    cores = os.cpu_count() or 1
    code = code_version()  # before anything runs: the code the figures come from
    log(f"calibration: {', '.join(sources)} with {', '.join(map(str, clients))} clients, "
        f"{reps} repetitions, on {cores} cores")

    def baseline() -> MachineSpeeds:
        speeds = measure_machine(directory, nbytes=measure_bytes, block_bytes=BLOCK_BYTES,
                                 nixl=nixl_read_rate(measure_bytes))
        log(describe(speeds))
        return speeds

    loads = measure_service(directory, reps=reps, blocks=blocks, clients=clients,
                            sources=sources, log=log, baseline=baseline)
    rows, control, below, costs = [], {}, [], {}
    for s in sources:
        costs[s] = [_control(loads.tiny[s], rep, _slot_s(s, loads.baselines[s][rep]))
                    for rep in range(reps)]
        control[s] = ControlCosts(statistics.median(c.fixed_s for c in costs[s]),
                                  statistics.median(c.per_block_s for c in costs[s]))
        more, under = _rows(loads, s, costs[s], blocks, clients, cores)
        rows += more
        below += under
    measured = _distinct(loads.baselines)
    own_cpu = {s: [(loads.load_cpu_alone(s, rep), loads.baselines[s][rep])
                   for rep in range(reps)] for s in sources}
    parameters = scenario_parameters(costs, own_cpu, measured, blocks * BLOCK_BYTES,
                                     measure_bytes)
    notes = (*_notes(loads, control, cores, sources, reps),
             "predicted loads that end before their CPU floor (the cores supplying N times "
             "one load's own CPU-seconds; CPU the model does not charge): " + ", ".join(below))
    raw = {"tiny_s": loads.tiny, "large_s": loads.large, "cpu_per_load_s": loads.cpu,
           "idle_busy_cores": loads.idle, "load_cpu_alone_s": _own(loads, sources, reps),
           "speeds": {k: [asdict(b) for b in v] for k, v in loads.baselines.items()}}
    return CalibrationResult(_median_speeds(measured), control, tuple(rows), notes, raw,
                             parameters, code=code)


def _own(loads: Any, sources: tuple[str, ...], reps: int) -> dict[str, list[float]]:
    """Each source's one load's own CPU-seconds alone, in every repetition that measured it."""
    own = {s: [c for rep in range(reps) if (c := loads.load_cpu_alone(s, rep)) is not None]
           for s in sources}
    return {s: v for s, v in own.items() if v}


def _notes(loads: Any, control: dict[str, ControlCosts], cores: int,
           sources: tuple[str, ...], reps: int) -> tuple[str, ...]:
    own = _own(loads, sources, reps)
    cpu = "; ".join(f"{src} " + ", ".join(f"{n} clients {statistics.median(v):.3f}"
                                          for n, v in sorted(per.items()))
                    for src, per in loads.cpu.items())
    return (f"load average {os.getloadavg()[0]:.1f} at the end, on {cores} cores",
            *loads.notes, *_in_round_trips(control, loads.round_trip_s),
            f"the machine's busy CPU-seconds per load (median over repetitions): {cpu}",
            "its busy cores with no load running: " + ", ".join(
                f"{src} {statistics.median(v):.2f}" for src, v in loads.idle.items()),
            "one load's own CPU-seconds alone (less those): " + ", ".join(
                f"{src} {statistics.median(own[src]):.3f}" for src in own))


def write_calibration(result: CalibrationResult, json_path: Path, docs: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    if docs is not None:
        rewrite_section(docs, result)
