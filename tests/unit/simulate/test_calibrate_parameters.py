"""The cluster scenarios' parameters against this machine: each scenario value read from the
simulator, each measured value from the run's own figures, and no value where none can be
measured here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cmx.simulate.calibrate.docs import render
from cmx.simulate.calibrate.parameters import NOT_HERE, agent_cpu_per_io, scenario_parameters
from cmx.simulate.calibrate.result import (
    CalibrationResult,
    ControlCosts,
    Kind,
    MachineSpeeds,
    Parameter,
    Spread,
)
from cmx.simulate.hardware import H100, NetworkSpec, NodeSpec
from cmx.simulate.strategy import CMX, LMCACHE_GDS_LIKE, LMCACHE_LIKE

MiB = 1 << 20
SPEEDS = MachineSpeeds(copy=4e9, copy_out=2e9, odirect_read=1e9, checksum=8e9, nixl=3e9,
                       nixl_note="test", odirect_latency_s=2e-4)
SLOW = replace(SPEEDS, copy=2e9, odirect_read=0.5e9, nixl=1e9, odirect_latency_s=6e-4)
NBYTES = 96 * MiB


def _parameters(speeds: tuple[MachineSpeeds, ...] = (SPEEDS, SLOW, SPEEDS)) -> dict[str, Parameter]:
    control = {"dram": [ControlCosts(0.002, 1e-5), ControlCosts(0.004, 3e-5),
                        ControlCosts(0.003, 2e-5)],
               "nvme": [ControlCosts(0.02, 0.0)]}
    own: dict[str, list[tuple[float | None, MachineSpeeds]]] = {
        "dram": [(0.06, SPEEDS), (None, SLOW)], "nvme": [(0.2, SPEEDS)]}
    return {p.name: p for p in scenario_parameters(control, own, speeds, NBYTES, 256 * MiB)}


def test_the_agents_cpu_per_io_is_a_loads_own_cpu_less_the_copies_the_model_charges() -> None:
    ios = NBYTES // (2 * MiB)
    assert agent_cpu_per_io(0.1, SPEEDS, "dram", NBYTES) == pytest.approx(
        (0.1 - NBYTES / SPEEDS.copy_out) / ios)
    # NVMe and peer loads: the agent's checksum of every block is charged too.
    assert agent_cpu_per_io(0.1, SPEEDS, "nvme", NBYTES) == pytest.approx(
        (0.1 - NBYTES / SPEEDS.copy_out - NBYTES / SPEEDS.checksum) / ios)


def test_each_measured_parameter_is_the_median_of_the_run_with_its_least_and_most() -> None:
    p = _parameters()
    control = p["control per load, dram"]
    assert (control.scenarios, control.kind) == (CMX.control_s, Kind.ASSUMED)
    assert control.measured == Spread((0.002, 0.004, 0.003))
    assert (control.measured.median, control.measured.low, control.measured.high) == (
        0.003, 0.002, 0.004)
    assert control.ratio == pytest.approx(0.003 / CMX.control_s)
    assert control.measured_kind is Kind.MEASURED
    per_block = p["control per block, dram"]
    assert per_block.scenarios == CMX.per_io_cpu_s + CMX.per_io_wait_s
    assert per_block.measured is not None and per_block.measured.median == pytest.approx(2e-5)
    read = p["NVMe read"]
    assert (read.scenarios, read.kind) == (NodeSpec().nvme.bandwidth, Kind.SEED)
    assert read.measured == Spread((1e9, 0.5e9, 1e9))
    assert p["NVMe latency, per I/O"].scenarios == NodeSpec().nvme.latency_s
    assert p["network: NIXL read between two processes"].scenarios == NetworkSpec().bandwidth
    assert p["host memory copy"].scenarios == NodeSpec().dram_bus_bandwidth


def test_the_agents_cpu_is_taken_from_the_repetitions_that_measured_it() -> None:
    cpu = _parameters()["agent CPU per 2 MiB moved, dram"]
    assert cpu.scenarios == CMX.per_io_cpu_s
    assert cpu.measured == Spread((agent_cpu_per_io(0.06, SPEEDS, "dram", NBYTES),))


def test_what_needs_a_gpu_or_a_nic_is_never_given_a_value() -> None:
    p = _parameters()
    for name, value in (("HBM bandwidth", H100.hbm_bandwidth),
                        ("DRAM -> HBM, one GPU's link", NodeSpec().dram.bandwidth),
                        ("network: the NIC, per node and direction", NetworkSpec().bandwidth),
                        ("LMCache-like: serving-process CPU per 256-token chunk",
                         LMCACHE_LIKE.per_io_cpu_s),
                        ("LMCache-GDS-like: CPU per 64 KiB GPUDirect read",
                         LMCACHE_GDS_LIKE.per_io_cpu_s)):
        assert p[name].scenarios == value and p[name].measured is None
    for q in NOT_HERE:
        assert (q.measured, q.ratio, q.measured_kind) == (None, None, None)
        assert q.measured_text() == "not measurable here" and q.how


def test_nixl_that_could_not_run_is_not_measured_rather_than_the_copy_speed() -> None:
    broken = replace(SPEEDS, nixl=SPEEDS.copy, nixl_note="NIXL unavailable (x)",
                     nixl_measured=False)
    nixl = _parameters((broken,))["network: NIXL read between two processes"]
    assert nixl.measured is None and "NIXL unavailable (x)" in nixl.how


def test_the_table_is_in_the_json_and_the_docs() -> None:
    params = tuple(_parameters().values())
    result = CalibrationResult(SPEEDS, {}, (), parameters=params)
    rows = result.to_dict()["parameters"]
    control = next(r for r in rows if r["name"] == "control per load, dram")
    assert control["measured"] == {"median": 0.003, "min": 0.002, "max": 0.004,
                                   "values": [0.002, 0.004, 0.003]}
    assert (control["scenarios"], control["unit"], control["scenarios_kind"],
            control["measured_kind"]) == (CMX.control_s, "s", "assumed", "measured")
    hbm = next(r for r in rows if r["name"] == "HBM bandwidth")
    assert (hbm["measured"], hbm["ratio"], hbm["measured_kind"]) == (None, None, None)
    text = render(result)
    assert "| control per load, dram | 0.20 ms (`strategy.CMX.control_s`) | assumed | " \
           "3.00 ms (2.00 to 4.00) | measured | 15x |" in text
    assert "| HBM bandwidth | 3,350 GB/s (`hardware.H100.hbm_bandwidth`) | seed | " \
           "not measurable here |  |  |" in text


def test_a_repetition_whose_cpu_came_to_no_more_than_the_copies_is_left_out_and_said() -> None:
    # A load's CPU read as 0 (10 ms ticks, clamped) is no measurement of a negative CPU.
    control = {"dram": [ControlCosts(3e-3, 2e-5)]}
    own = {"dram": [(0.06, SPEEDS), (0.0, SPEEDS), (0.07, SPEEDS)]}
    (cpu,) = [p for p in scenario_parameters(control, own, (SPEEDS,), NBYTES, 256 * MiB)
              if p.name == "agent CPU per 2 MiB moved, dram"]
    assert cpu.measured is not None and min(cpu.measured.values) > 0
    assert len(cpu.measured.values) == 2
    assert "1 of 3 repetitions left out" in cpu.how
