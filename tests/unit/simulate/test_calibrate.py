"""The calibration's prediction and its docs section, without Ray (the measurements need a
cluster; ``cmx simulate --calibrate`` runs them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cmx.simulate.calibrate.docs import BEGIN, END, render, rewrite_section
from cmx.simulate.calibrate.predict import predict_load
from cmx.simulate.calibrate.result import CalibrationResult, ControlCosts, MachineSpeeds, Row

MiB = 1 << 20
SPEEDS = MachineSpeeds(copy=4e9, copy_out=2e9, odirect_read=1e9, checksum=8e9, nixl=3e9,
                       nixl_note="test")
COSTS = ControlCosts(fixed_s=0.01, per_block_s=0.002)


@pytest.mark.parametrize("source, link, checksums", [
    ("dram", None, 0),  # read in place in the DRAM arena; the client checks as it copies out
    ("nvme", SPEEDS.odirect_read, 1),  # O_DIRECT into the arena, checked by the agent
    ("dram@peer", SPEEDS.nixl, 1),  # NIXL into the arena, checked by the agent
])
def test_the_simulator_adds_up_a_loads_parts_as_the_service_takes_them(
    source: str, link: float | None, checksums: int,
) -> None:
    blocks, block = 16, 16 * MiB
    nbytes = blocks * block
    expected = (COSTS.fixed_s + blocks * COSTS.per_block_s + (nbytes / link if link else 0.0)
                + nbytes / SPEEDS.copy_out + checksums * nbytes / SPEEDS.checksum)
    assert predict_load(SPEEDS, COSTS, source, blocks, block) == pytest.approx(expected)


def _result(error: float) -> CalibrationResult:
    predicted = tuple(x * (1.0 + error) for x in (1.2, 1.0, 3.0))
    row = Row("dram", 4, 16, 256 * MiB, (1.2, 1.0, 3.0), predicted)
    return CalibrationResult(SPEEDS, {"dram": COSTS}, (row,), ("a note",))


def test_a_prediction_passes_within_25_percent_and_misses_beyond() -> None:
    assert _result(0.2).ok and not _result(0.3).ok and not _result(-0.3).ok
    assert _result(0.2).rows[0].ok and not _result(-0.3).rows[0].ok


def test_a_cell_compares_the_median_load_with_the_median_prediction() -> None:
    row = Row("nvme", 4, 16, 256 * MiB, (1.0, 9.0, 2.0, 1.5), (3.0, 0.1, 2.4))
    assert (row.measured, row.predicted) == (1.75, 2.4)
    assert row.error == pytest.approx(2.4 / 1.75 - 1) and not row.ok


def test_each_speed_recorded_is_the_median_of_the_repetitions() -> None:
    from cmx.simulate.calibrate.run import _median_speeds

    slow = MachineSpeeds(copy=1e9, copy_out=3e9, odirect_read=0.5e9, checksum=9e9, nixl=1e9,
                         nixl_note="test", odirect_latency_s=1e-3)
    fast = replace(SPEEDS, odirect_latency_s=1e-4)
    mid = _median_speeds([fast, slow, fast])
    assert (mid.copy, mid.copy_out, mid.odirect_read, mid.checksum, mid.nixl) == (
        4e9, 2e9, 1e9, 8e9, 3e9)
    assert mid.odirect_latency_s == 1e-4


def test_a_row_is_judged_by_its_prediction_never_by_its_floor() -> None:
    off = Row("dram", 4, 6, 96 * MiB, (1.0, 1.0), (1.5, 1.5), floor_s=(1.0, 1.0))
    assert off.floor == 1.0 and off.error == pytest.approx(0.5) and not off.ok
    below = Row("dram", 4, 6, 96 * MiB, (1.0,), (1.1,), floor_s=(3.0,))
    assert below.predicted == 1.1 and below.ok  # a floor above: information, not a verdict
    assert Row("dram", 1, 6, 96 * MiB, (1.0,), (1.0,)).floor is None


def test_the_docs_show_the_prediction_and_the_floor_in_columns_of_their_own() -> None:
    rows = (Row("dram", 4, 6, 96 * MiB, (1.0,), (1.5,), floor_s=(2.0, 4.0)),
            Row("nvme", 1, 6, 96 * MiB, (1.0,), (1.0,)))
    text = render(CalibrationResult(SPEEDS, {"dram": COSTS}, rows))
    assert "| 1.000 | 1.500 | 3.000 | +50.0% | **MISS** |" in text
    assert "| 1.000 | 1.000 | not measured | +0.0% | **PASS** |" in text


def test_the_docs_section_is_replaced_between_its_markers_and_nothing_else(
    tmp_path: Path,
) -> None:
    page = tmp_path / "B.md"
    page.write_text("# head\n\nbefore\n")
    rewrite_section(page, _result(0.1))
    first = page.read_text()
    assert first.startswith("# head\n\nbefore\n") and first.count(BEGIN) == 1
    page.write_text(first + "\nafter\n")
    rewrite_section(page, _result(0.5))
    text = page.read_text()
    assert text.count(BEGIN) == text.count(END) == 1
    assert "**MISS**" in text and "**PASS**" not in text and text.endswith("after\n")


def test_control_costs_come_from_the_tiny_loads_less_the_slots_a_peer_moves() -> None:
    from cmx.simulate.calibrate.run import _control

    tiny = {1: [0.012], 8: [0.026]}
    local = _control(tiny, 0)
    assert local.per_block_s == pytest.approx(0.002) and local.fixed_s == pytest.approx(0.010)
    peer = _control(tiny, 0, slot_s=0.0015)  # each tiny block moved a whole slot
    assert peer.per_block_s == pytest.approx(0.0005) and peer.fixed_s == pytest.approx(0.010)
