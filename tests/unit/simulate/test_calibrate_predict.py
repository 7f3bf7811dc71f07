"""The calibration's prediction of N loads at once: links through the simulator, CPU work
shared by the cores."""

from __future__ import annotations

import pytest

from cmx.simulate.calibrate.predict import cpu_seconds, predict_loads
from cmx.simulate.calibrate.result import ControlCosts, MachineSpeeds

MiB = 1 << 20
SPEEDS = MachineSpeeds(copy=4e9, copy_out=2e9, odirect_read=1e9, checksum=8e9, nixl=3e9,
                       nixl_note="test")
COSTS = ControlCosts(fixed_s=0.01, per_block_s=0.002)


def test_four_dram_loads_on_two_cores_share_the_cpu_work() -> None:
    blocks, block = 4, 16 * MiB
    work = cpu_seconds(SPEEDS, "dram", blocks * block)
    control = COSTS.fixed_s + blocks * COSTS.per_block_s  # the DRAM link is CPU work here
    # Four agent lanes: every load's control ends at once; then two threads for four loads.
    times = predict_loads(SPEEDS, COSTS, "dram", blocks, block, clients=4, cores=2)
    assert times == pytest.approx([control + 2 * work] * 4)
    alone = predict_loads(SPEEDS, COSTS, "dram", blocks, block, clients=1, cores=2)
    assert alone == pytest.approx([control + work])


def test_peer_loads_queue_on_the_network_link() -> None:
    blocks, block = 4, 16 * MiB
    nic_s = blocks * block / SPEEDS.nixl
    no_io_cost = ControlCosts(fixed_s=0.01, per_block_s=0.0)
    # As many cores as loads: the CPU is not shared, the NIC serves one prefix after another.
    times = sorted(predict_loads(SPEEDS, no_io_cost, "dram@peer", blocks, block, clients=4,
                                 cores=4))
    work = cpu_seconds(SPEEDS, "dram@peer", blocks * block)
    assert times == pytest.approx([0.01 + k * nic_s + work for k in (1, 2, 3, 4)])


def test_the_cpu_floor_is_the_time_the_cores_take_to_supply_every_loads_cpu() -> None:
    from cmx.simulate.calibrate.predict import cpu_floor

    # 16 loads of 0.1 CPU-s each on 2 cores: none can end before 0.8 s.
    assert cpu_floor(16, 0.1, 2) == pytest.approx(0.8)
    assert cpu_floor(1, 0.1, 2) == pytest.approx(0.05)
    assert cpu_floor(4, None, 2) is None  # not measured: no floor
    with pytest.raises(ValueError):
        cpu_floor(4, 0.1, 0)


def test_loads_on_every_core_copy_out_at_the_speed_measured_so() -> None:
    from dataclasses import replace

    blocks, block = 4, 16 * MiB
    shared = replace(SPEEDS, copy_out_shared=SPEEDS.copy_out / 2)
    control = COSTS.fixed_s + blocks * COSTS.per_block_s
    alone = predict_loads(shared, COSTS, "dram", blocks, block, clients=1, cores=2)
    assert alone == pytest.approx([control + blocks * block / SPEEDS.copy_out])
    # Two threads copying at once, each at half the speed of one alone.
    two = predict_loads(shared, COSTS, "dram", blocks, block, clients=2, cores=2)
    assert two == pytest.approx([control + 2 * blocks * block / SPEEDS.copy_out] * 2)
    assert cpu_seconds(shared, "nvme", blocks * block, threads=2) == pytest.approx(
        blocks * block / (SPEEDS.copy_out / 2) + blocks * block / SPEEDS.checksum)


def test_sixteen_loads_share_the_cores_once_the_agents_four_lanes_let_them_go() -> None:
    # The copy out is the client's work, not the agent lane's: sixteen loads through four
    # lanes reach the cores together and share them, not in waves of four.
    blocks, block = 4, 16 * MiB
    no_control = ControlCosts(fixed_s=0.0, per_block_s=0.0)
    times = predict_loads(SPEEDS, no_control, "dram", blocks, block, clients=16, cores=2)
    work = cpu_seconds(SPEEDS, "dram", blocks * block, threads=2)
    assert times == pytest.approx([16 * work / 2] * 16)
